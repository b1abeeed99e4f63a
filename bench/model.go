package main

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/gorm-outbox/outbox"
)

// benchOrder is the business row of every write: an order placed by one
// of a fixed set of customers. Each order emits one event on its customer's
// aggregate, so the per-aggregate sequence upsert updates an existing row
// most of the time, as it does in a service with a steady customer base.
type benchOrder struct {
	ID          uint64 `gorm:"primaryKey"`
	CustomerID  string `gorm:"not null"`
	Status      string `gorm:"not null"`
	AmountCents int64  `gorm:"not null"`
	Currency    string `gorm:"not null"`
	Note        string `gorm:"not null"`
	CreatedAt   time.Time

	// EventID, when set, becomes the ID of the order's event, so that the
	// latency scenario can match a commit with its publish.
	EventID string `gorm:"-"`
}

func (benchOrder) TableName() string { return "bench_orders" }

// orderPayload is the event's JSON document, about 230 bytes.
type orderPayload struct {
	OrderID     uint64    `json:"order_id"`
	CustomerID  string    `json:"customer_id"`
	Status      string    `json:"status"`
	AmountCents int64     `json:"amount_cents"`
	Currency    string    `json:"currency"`
	Note        string    `json:"note"`
	PlacedAt    time.Time `json:"placed_at"`
}

const (
	eventType     = "customer.order_placed"
	aggregateType = "customer"
	orderNote     = "deliver to the back door; call ahead; fragile items inside"
)

func (o *benchOrder) payload() orderPayload {
	return orderPayload{
		OrderID: o.ID, CustomerID: o.CustomerID, Status: o.Status,
		AmountCents: o.AmountCents, Currency: o.Currency, Note: o.Note, PlacedAt: o.CreatedAt,
	}
}

// OutboxEvents makes benchOrder an outbox.Emitter.
func (o *benchOrder) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	if op != outbox.OpCreate {
		return nil, nil
	}
	return []outbox.Event{{
		ID:            o.EventID,
		Type:          eventType,
		AggregateType: aggregateType,
		AggregateID:   o.CustomerID,
		Payload:       o.payload(),
	}}, nil
}

// customerID names one of n customers.
func customerID(i int) string { return fmt.Sprintf("customer-%06d", i) }

// newOrder returns an order of a random customer among n.
func newOrder(rnd *rand.Rand, customers int) benchOrder {
	return benchOrder{
		CustomerID:  customerID(rnd.IntN(customers)),
		Status:      "placed",
		AmountCents: 100 + rnd.Int64N(100_000),
		Currency:    "EUR",
		Note:        orderNote,
		CreatedAt:   time.Now().UTC(),
	}
}

func encodePayload(o *benchOrder) (string, error) {
	b, err := json.Marshal(o.payload())
	return string(b), err
}
