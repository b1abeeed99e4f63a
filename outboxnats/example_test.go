package outboxnats_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxnats"
)

func ExampleNew() {
	nc, err := nats.Connect(natsURL())
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// The stream that stores the events, with the duplicate window that
	// makes redeliveries harmless.
	name := fmt.Sprintf("EXAMPLE_ORDERS_%d", os.Getpid())
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name: name, Subjects: []string{name + ".>"}, Duplicates: 5 * time.Minute,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer js.DeleteStream(context.Background(), name)

	pub, err := outboxnats.New(js,
		outboxnats.WithSource("/shop"),
		outboxnats.WithSubject(func(m outbox.Message) string { return name + "." + m.EventType }))
	if err != nil {
		log.Fatal(err)
	}
	// In an application: outbox.NewDispatcher(db, pub) and Run.
	batch := outbox.Batch{ID: "b1", Messages: []outbox.Message{{
		EventID: "evt-1", EventType: "order.created", AggregateType: "order", AggregateID: "42",
		Sequence: 1, Payload: []byte(`{"total":1250}`), OccurredAt: time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC),
	}}}
	for range 2 { // a redelivery is dropped by the stream
		if err := pub.Publish(ctx, batch); err != nil {
			log.Fatal(err)
		}
	}

	msg, err := stream.GetMsg(ctx, 1)
	if err != nil {
		log.Fatal(err)
	}
	info, _ := stream.Info(ctx)
	fmt.Println("stored:", info.State.Msgs)
	fmt.Println("body:", string(msg.Data))
	for _, h := range []string{"ce-id", "ce-type", "ce-source", "ce-subject", "ce-aggregatesequence", "Nats-Msg-Id"} {
		fmt.Printf("%s: %s\n", h, msg.Header.Get(h))
	}
	// Output:
	// stored: 1
	// body: {"total":1250}
	// ce-id: evt-1
	// ce-type: order.created
	// ce-source: /shop
	// ce-subject: order/42
	// ce-aggregatesequence: 1
	// Nats-Msg-Id: evt-1
}
