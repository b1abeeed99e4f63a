package outboxamqp_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxamqp"
)

func ExampleNew() {
	conn, err := amqp.Dial(amqpURL())
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()

	// The application's topology: a topic exchange and a queue for the
	// order events.
	setup, err := conn.Channel()
	if err != nil {
		log.Fatal(err)
	}
	exchange := fmt.Sprintf("example.orders.%d", os.Getpid())
	queue := exchange + ".billing"
	if err := setup.ExchangeDeclare(exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		log.Fatal(err)
	}
	defer setup.ExchangeDelete(exchange, false, false)
	if _, err := setup.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		log.Fatal(err)
	}
	defer setup.QueueDelete(queue, false, false, false)
	if err := setup.QueueBind(queue, "order.*", exchange, false, nil); err != nil {
		log.Fatal(err)
	}

	pub, err := outboxamqp.New(conn, outboxamqp.WithExchange(exchange), outboxamqp.WithSource("/shop"))
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	// In an application: outbox.NewDispatcher(db, pub) and Run.
	batch := outbox.Batch{ID: "b1", Messages: []outbox.Message{{
		EventID: "evt-1", EventType: "order.created", AggregateType: "order", AggregateID: "42",
		Sequence: 1, Payload: []byte(`{"total":1250}`), OccurredAt: time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC),
	}}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := pub.Publish(ctx, batch); err != nil {
		log.Fatal(err)
	}

	d, ok, err := setup.Get(queue, true)
	if err != nil || !ok {
		log.Fatal("no message in the queue: ", err)
	}
	fmt.Println("body:", string(d.Body))
	fmt.Println("content-type:", d.ContentType, "message-id:", d.MessageId, "type:", d.Type)
	for _, h := range []string{"cloudEvents_id", "cloudEvents_source", "cloudEvents_subject", "cloudEvents_aggregatesequence"} {
		fmt.Printf("%s: %v\n", h, d.Headers[h])
	}
	// Output:
	// body: {"total":1250}
	// content-type: application/json message-id: evt-1 type: order.created
	// cloudEvents_id: evt-1
	// cloudEvents_source: /shop
	// cloudEvents_subject: order/42
	// cloudEvents_aggregatesequence: 1
}
