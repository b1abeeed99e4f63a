package outboxkafka_test

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxkafka"
)

func ExampleNew() {
	// An in-process Kafka cluster stands in for the real one.
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cluster.Close()

	// franz-go's default producer: idempotent, acks from all replicas.
	cl, err := kgo.NewClient(kgo.SeedBrokers(cluster.ListenAddrs()...))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cl.Close()
	pub, err := outboxkafka.New(cl,
		outboxkafka.WithTopic(func(outbox.Message) string { return "orders" }),
		outboxkafka.WithSource("/shop/orders"))
	if err != nil {
		fmt.Println(err)
		return
	}
	// A dispatcher calls Publish: outbox.NewDispatcher(db, pub).
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = pub.Publish(ctx, outbox.Batch{ID: "batch-1", Messages: []outbox.Message{{
		EventID: "evt-1", EventType: "order.created", AggregateType: "order", AggregateID: "42",
		Sequence: 1, Payload: json.RawMessage(`{"total":1250}`),
		Headers:    map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		OccurredAt: time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC),
	}}})
	fmt.Println("publish error:", err)

	consumer, err := kgo.NewClient(kgo.SeedBrokers(cluster.ListenAddrs()...), kgo.ConsumeTopics("orders"),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer consumer.Close()
	rec := consumer.PollFetches(ctx).Records()[0]
	fmt.Printf("key %s, value %s\n", rec.Key, rec.Value)
	for _, h := range rec.Headers {
		fmt.Printf("%s: %s\n", h.Key, h.Value)
	}
	// Output:
	// publish error: <nil>
	// key order/42, value {"total":1250}
	// ce_id: evt-1
	// ce_source: /shop/orders
	// ce_specversion: 1.0
	// ce_type: order.created
	// ce_time: 2024-05-06T07:08:09Z
	// ce_subject: order/42
	// content-type: application/json
	// ce_partitionkey: order/42
	// ce_aggregatetype: order
	// ce_aggregateid: 42
	// ce_aggregatesequence: 1
	// traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01
}
