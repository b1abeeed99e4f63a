package outboxamqp_test

import (
	"os"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest/brokertest"
	"github.com/gorm-outbox/outbox/outboxamqp"
)

// The test binary doubles as the kill test's dispatcher processes.
func TestMain(m *testing.M) { brokertest.Main(m, helperPublisher) }

// envExchange names the kill test's exchange, for its dispatcher
// processes.
const envExchange = "OUTBOX_AMQP_HELPER_EXCHANGE"

// helperPublisher is the publisher of a dispatcher process: to the
// exchange in envExchange, routed by aggregate.
func helperPublisher() (outbox.Publisher, error) {
	conn, err := amqp.Dial(amqpURL())
	if err != nil {
		return nil, err
	}
	return outboxamqp.New(conn, outboxamqp.WithExchange(os.Getenv(envExchange)), outboxamqp.WithRoutingKey(routeByAggregate))
}

// TestKilledDispatcherIsReplacedWithoutLoss kills dispatcher processes
// with SIGKILL while they publish a backlog to RabbitMQ and starts a new
// one each time. The queue ends with every committed event at least once
// (RabbitMQ does not deduplicate: the interrupted batches arrive twice),
// first arrivals in sequence order per aggregate, and none of a
// rolled-back transaction.
func TestKilledDispatcherIsReplacedWithoutLoss(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "#")
	db, info := brokertest.OpenOutbox(t)
	// The backlog stays within one claim's scan window (1,000 due rows),
	// where a replacement finds the killed batches' expired leases.
	w := brokertest.WriteEvents(t, db, 600, 10)

	brokertest.NewProcesses(t, info, 25, envExchange+"="+tp.exchange).KillDuringPublishes(db, 3)
	redelivered := 0
	for _, n := range brokertest.CheckDelivered(t, tp.events(t, len(w.Committed)), w.Committed) {
		redelivered += n - 1
	}
	t.Logf("%d committed events, %d copies more after the kills", len(w.Committed), redelivered)
}
