package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"

	"github.com/gorm-outbox/outbox"
)

func ExampleHandlers() {
	h, err := outbox.NewHandlers() // FailUnhandled: an unknown event type is dead-lettered
	if err != nil {
		log.Fatal(err)
	}
	err = h.Handle("order.created", func(ctx context.Context, m outbox.Message) error {
		var order struct {
			Total int `json:"total"`
		}
		if err := json.Unmarshal(m.Payload, &order); err != nil {
			return outbox.Permanent(err) // a malformed payload will not improve on retry
		}
		fmt.Printf("%s %s/%s #%d (%s): total %d\n",
			m.EventType, m.AggregateType, m.AggregateID, m.Sequence, m.EventID, order.Total)
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}

	// In a service, h is given to outbox.NewDispatcher, which calls Publish
	// with the batches it claims. Here a batch is made by hand.
	err = h.Publish(context.Background(), outbox.Batch{
		ID: "batch-1",
		Messages: []outbox.Message{
			{EventID: "evt-1", EventType: "order.created", AggregateType: "order", AggregateID: "42",
				Sequence: 1, Payload: json.RawMessage(`{"total": 1250}`)},
			{EventID: "evt-2", EventType: "order.shipped", AggregateType: "order", AggregateID: "42",
				Sequence: 2, Payload: json.RawMessage(`{}`)},
		},
	})
	var partial *outbox.PartialError
	if errors.As(err, &partial) {
		fmt.Println("evt-2:", partial.Failed["evt-2"])
	}
	// Output:
	// order.created order/42 #1 (evt-1): total 1250
	// evt-2: permanent: outbox: no handler for event type: "order.shipped"
}
