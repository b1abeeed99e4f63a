package outboxkafka_test

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest/brokertest"
	"github.com/gorm-outbox/outbox/outboxkafka"
)

// The test binary doubles as the kill test's dispatcher processes.
func TestMain(m *testing.M) { brokertest.Main(m, helperPublisher) }

// The kill test's dispatcher processes publish to the topic in envTopic
// of the cluster whose brokers envBrokers lists, comma-separated.
const (
	envBrokers = "OUTBOXKAFKA_BROKERS"
	envTopic   = "OUTBOXKAFKA_TOPIC"
)

// helperPublisher is the publisher of a dispatcher process.
func helperPublisher() (outbox.Publisher, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(strings.Split(os.Getenv(envBrokers), ",")...), kgo.AllowAutoTopicCreation())
	if err != nil {
		return nil, err
	}
	return outboxkafka.New(cl, toTopic(os.Getenv(envTopic)))
}

func TestDispatcherDeliversEveryCommittedEventAndNoneRolledBack(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 3)
	topic := uniqueTopic(t)
	db, _ := brokertest.OpenOutbox(t)
	w := brokertest.WriteEvents(t, db, 30, 4)

	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(topic))
	brokertest.DeliverAll(t, db, p, outbox.WithBatchSize(7), outbox.WithPublishTimeout(5*time.Second))
	recs := consume(t, c.ListenAddrs(), topic, len(w.Committed), 5*time.Second)
	brokertest.CheckEachOnce(t, brokertest.CheckDelivered(t, decodeAll(t, recs), w.Committed))
}

func TestDispatcherDeadLettersAnOversizedEventAndHoldsBackItsAggregate(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(uniqueTopic(t)))
	// The largest payload the outbox takes (a JSON string's text is its
	// characters and two quotes), more than a Kafka message holds with its
	// envelope.
	brokertest.CheckOversizedEventIsDeadLettered(t, p, outbox.DefaultMaxPayloadBytes-2)
}

func TestDispatcherKilledMidBatchIsReplacedWithoutLosingEvents(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 3)
	topic := uniqueTopic(t)
	db, info := brokertest.OpenOutbox(t)
	w := brokertest.WriteEvents(t, db, 40, 5)

	ps := brokertest.NewProcesses(t, info, 5, envTopic+"="+topic, envBrokers+"="+strings.Join(c.ListenAddrs(), ","))
	killed := ps.KillBetweenAcknowledgementAndSettle()
	brokertest.WaitDelivered(t, db, 15*time.Second)

	recs := consume(t, c.ListenAddrs(), topic, len(w.Committed)+len(killed), 3*time.Second)
	copies := brokertest.CheckDelivered(t, decodeAll(t, recs), w.Committed)
	// Kafka does not deduplicate what the dispatcher sends again: the
	// killed batch is in the topic twice, and consumers deduplicate on ce_id.
	for _, id := range killed {
		if copies[id] != 2 {
			t.Errorf("event %s of the killed batch is in the topic %d times, want 2", id, copies[id])
		}
	}
}

func TestDispatcherRetriesABatchTheClusterDidNotAcknowledge(t *testing.T) {
	t.Parallel()
	p := newPublisher(t, newClient(t, []string{"127.0.0.1:1"}), toTopic("unreachable"))
	got := brokertest.Dispatch(t, p, []outbox.Event{
		{ID: "a", Type: "t", AggregateType: "order", AggregateID: "1", Payload: 1},
		{ID: "b", Type: "t", AggregateType: "order", AggregateID: "2", Payload: 2},
	}, outbox.WithPublishTimeout(500*time.Millisecond))
	brokertest.CheckStates(t, got, map[string]string{"a": "retry/1", "b": "retry/1"})
}
