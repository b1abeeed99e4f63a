package outboxredis_test

import (
	"os"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest/brokertest"
	"github.com/gorm-outbox/outbox/outboxredis"
)

// The test binary doubles as the kill test's dispatcher processes.
func TestMain(m *testing.M) { brokertest.Main(m, helperPublisher) }

// envStream names the kill test's stream, for its dispatcher processes.
const envStream = "OUTBOXREDIS_STREAM"

// helperPublisher is the publisher of a dispatcher process: to the stream
// in envStream.
func helperPublisher() (outbox.Publisher, error) {
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr(), ContextTimeoutEnabled: true})
	return outboxredis.New(rdb, toStream(os.Getenv(envStream)))
}

func TestDispatcherDeliversEveryCommittedEventAndNoneRolledBack(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	stream := uniqueStream(t, rdb)
	db, _ := brokertest.OpenOutbox(t)
	w := brokertest.WriteEvents(t, db, 40, 4)

	brokertest.DeliverAll(t, db, newPublisher(t, rdb, toStream(stream)), outbox.WithBatchSize(7))
	brokertest.CheckEachOnce(t, brokertest.CheckDelivered(t, events(t, rdb, stream), w.Committed))
}

func TestDispatcherKilledMidBatchIsReplacedWithoutLosingEvents(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	stream := uniqueStream(t, rdb)
	db, info := brokertest.OpenOutbox(t)
	w := brokertest.WriteEvents(t, db, 40, 5)

	ps := brokertest.NewProcesses(t, info, 5, envStream+"="+stream)
	killed := ps.KillBetweenAcknowledgementAndSettle() // in Redis, not settled
	// Events written while the replacement runs are delivered too.
	w.Add(brokertest.WriteEvents(t, db, 8, 5))
	brokertest.WaitDelivered(t, db, 15*time.Second)

	copies := brokertest.CheckDelivered(t, events(t, rdb, stream), w.Committed)
	idmp, err := newPublisher(t, rdb).Idempotent(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	want := 2 // the replacement sent the killed batch again
	if idmp {
		want = 1
	}
	for _, id := range killed {
		if copies[id] != want {
			t.Errorf("event %s of the killed batch is in the stream %d times, want %d (IDMP %v)", id, copies[id], want, idmp)
		}
	}
}

func TestDispatcherSettlesAccordingToTheFault(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	t.Run("oversized message dead-lettered alone", func(t *testing.T) {
		t.Parallel()
		p := newPublisher(t, rdb, toStream(uniqueStream(t, rdb)))
		p.LimitArgumentBytes(1 << 10)
		brokertest.CheckOversizedEventIsDeadLettered(t, p, 2<<10, outbox.WithPublishTimeout(2*time.Second))
	})
	t.Run("unreachable server retried", func(t *testing.T) {
		t.Parallel()
		down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true, MaxRetries: -1})
		t.Cleanup(func() { down.Close() })
		// The same events: with no server, none of them is sent.
		got := brokertest.Dispatch(t, newPublisher(t, down), brokertest.OversizedEvents(2<<10), outbox.WithPublishTimeout(2*time.Second))
		brokertest.CheckStates(t, got, map[string]string{"big": "retry/1", "after-big": "retry/1", "other": "retry/1"})
	})
}
