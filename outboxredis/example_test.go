package outboxredis_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxredis"
)

func ExampleNew() {
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr(), ContextTimeoutEnabled: true})
	defer rdb.Close()
	stream := fmt.Sprintf("outboxredis-example:%d", os.Getpid())
	defer rdb.Del(context.Background(), stream)

	pub, err := outboxredis.New(rdb,
		outboxredis.WithStream(func(outbox.Message) string { return stream }),
		outboxredis.WithSource("/shop/orders"))
	if err != nil {
		fmt.Println(err)
		return
	}
	// A dispatcher calls Publish: outbox.NewDispatcher(db, pub).
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err = pub.Publish(ctx, outbox.Batch{ID: "batch-1", Messages: []outbox.Message{{
		EventID: "evt-1", EventType: "order.created", AggregateType: "order", AggregateID: "42",
		Sequence: 1, Payload: json.RawMessage(`{"total":1250}`),
		Headers:    map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		OccurredAt: time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC),
	}}})
	fmt.Println("publish error:", err)

	// XRANGE returns the fields as a map; read them in the order they
	// were written.
	entries, err := rdb.XRange(ctx, stream, "-", "+").Result()
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, name := range []string{"id", "source", "specversion", "type", "time", "subject", "datacontenttype",
		"partitionkey", "aggregatetype", "aggregateid", "aggregatesequence", "header.traceparent", "data"} {
		fmt.Printf("%s: %s\n", name, entries[0].Values[name])
	}
	// Output:
	// publish error: <nil>
	// id: evt-1
	// source: /shop/orders
	// specversion: 1.0
	// type: order.created
	// time: 2024-05-06T07:08:09Z
	// subject: order/42
	// datacontenttype: application/json
	// partitionkey: order/42
	// aggregatetype: order
	// aggregateid: 42
	// aggregatesequence: 1
	// header.traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01
	// data: {"total":1250}
}
