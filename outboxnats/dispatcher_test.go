package outboxnats_test

import (
	"os"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest/brokertest"
	"github.com/gorm-outbox/outbox/outboxnats"
)

// The test binary doubles as the kill test's dispatcher processes.
func TestMain(m *testing.M) { brokertest.Main(m, helperPublisher) }

// envPrefix names the subject prefix of the kill test's stream, for its
// dispatcher processes.
const envPrefix = "OUTBOX_NATS_HELPER_PREFIX"

// helperPublisher is the publisher of a dispatcher process: to the
// stream bound to the prefix in envPrefix, by aggregate type.
func helperPublisher() (outbox.Publisher, error) {
	nc, err := nats.Connect(natsURL())
	if err != nil {
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	prefix := os.Getenv(envPrefix)
	return outboxnats.New(js, outboxnats.WithSubject(func(m outbox.Message) string { return prefix + "." + m.AggregateType }))
}

func TestDispatcherDeliversEveryCommittedEvent(t *testing.T) {
	t.Parallel()
	js := connect(t)
	s := newStream(t, js, jetstream.StreamConfig{})
	db, _ := brokertest.OpenOutbox(t)
	w := brokertest.WriteEvents(t, db, 200, 10)

	brokertest.DeliverAll(t, db, newPublisher(t, js, outboxnats.WithSubject(s.subject)), outbox.WithBatchSize(64))
	brokertest.CheckEachOnce(t, brokertest.CheckDelivered(t, s.events(t), w.Committed))
}

func TestDispatcherDeadLettersAnOversizedEventAndHoldsBackItsAggregate(t *testing.T) {
	t.Parallel()
	js := connect(t)
	s := newStream(t, js, jetstream.StreamConfig{MaxMsgSize: 4096})
	brokertest.CheckOversizedEventIsDeadLettered(t, newPublisher(t, js, outboxnats.WithSubject(s.subject)), 8192)
}

// TestKilledDispatcherIsReplacedWithoutLossOrDuplicates kills dispatcher
// processes with SIGKILL while they publish a backlog to NATS and starts
// a new one each time. Within the stream's duplicate window the stream
// ends with every committed event exactly once, in sequence order per
// aggregate, and none of a rolled-back transaction.
func TestKilledDispatcherIsReplacedWithoutLossOrDuplicates(t *testing.T) {
	t.Parallel()
	js := connect(t)
	s := newStream(t, js, jetstream.StreamConfig{Duplicates: 2 * time.Minute})
	db, info := brokertest.OpenOutbox(t)
	// The backlog stays within one claim's scan window (1,000 due rows),
	// where a replacement finds the killed batches' expired leases.
	w := brokertest.WriteEvents(t, db, 600, 10)

	brokertest.NewProcesses(t, info, 25, envPrefix+"="+s.prefix).KillDuringPublishes(db, 3)
	brokertest.CheckEachOnce(t, brokertest.CheckDelivered(t, s.events(t), w.Committed))
}
