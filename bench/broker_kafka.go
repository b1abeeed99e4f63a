package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/cloudevent"
	"github.com/gorm-outbox/outbox/outboxkafka"
)

// The kafka scenario: events per second from a backlog on PostgreSQL
// through one outbox dispatcher and outboxkafka into Kafka (franz-go's
// in-process kfake cluster, one broker, 8 partitions: no Kafka server can
// run here), next to franz-go producing the same records asynchronously in
// a loop (the broker's ceiling on this machine) and the raw-SQL loop with
// a no-op publisher (the database's), and the dispatcher into a no-op
// publisher. Each drain gets a fresh cluster and a fresh schema; the four
// run interleaved, c.repeat times, and each figure is the median.

// brokerBacklog is the backlog of the broker scenarios: the dispatch
// backlog, up to 50,000 events, so that the brokers' memory stays small.
func brokerBacklog(c config) int { return min(c.backlog, 50_000) }

// kafkaRedisBatch is the dispatcher's batch size in the broker scenarios.
func kafkaRedisBatch(c config) int { return c.batchSizes[len(c.batchSizes)-1] }

func runKafka(ctx context.Context, e *env, c config, r *report) error {
	n, batch := brokerBacklog(c), kafkaRedisBatch(c)
	g := []drainSpec{
		{"outbox → outboxkafka", fmt.Sprintf("1 dispatcher, batch %d", batch), "broker_kafka_outbox", func() (drainResult, error) {
			return withKafka(func(addrs []string) (drainResult, error) {
				cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...))
				if err != nil {
					return drainResult{}, err
				}
				defer cl.Close()
				pub, err := outboxkafka.New(cl, outboxkafka.WithTopic(func(outbox.Message) string { return "bench" }))
				if err != nil {
					return drainResult{}, err
				}
				return pgOutboxDrain(ctx, e, "kafka", n, c.aggregates, func(ctx context.Context, s *schema) (drainResult, error) {
					return drainOutboxInto(ctx, func() (*gorm.DB, error) { return s.gormDB(3) }, pub, batch, n)
				})
			})
		}},
		{"franz-go alone", "async Produce of every record, then wait for all acks", "broker_kafka_client", func() (drainResult, error) {
			return withKafka(func(addrs []string) (drainResult, error) { return kafkaClientLoop(ctx, addrs, n, c.aggregates) })
		}},
		{"raw SQL loop", fmt.Sprintf("1 worker, batch %d, no-op publisher", batch), "broker_kafka_raw", func() (drainResult, error) {
			return pgOutboxDrain(ctx, e, "kafka_raw", n, c.aggregates, func(ctx context.Context, s *schema) (drainResult, error) {
				return drainRaw(ctx, func() (*sql.DB, error) { return s.sqlDB(2) }, rawPostgres, 1, batch, n)
			})
		}},
		outboxNoop(ctx, e, c, "kafka"),
	}
	return brokerTable(r, "kafka (kfake, in process)", n, c, g)
}

// outboxNoop is the broker scenarios' fourth drain: the same dispatcher
// into a no-op publisher, which tells the publisher's share of the time
// from the dispatcher's.
func outboxNoop(ctx context.Context, e *env, c config, broker string) drainSpec {
	n, batch := brokerBacklog(c), kafkaRedisBatch(c)
	noop := outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil })
	return drainSpec{"outbox, no-op publisher", fmt.Sprintf("1 dispatcher, batch %d", batch), "broker_" + broker + "_outbox_noop", func() (drainResult, error) {
		return pgOutboxDrain(ctx, e, broker+"_noop", n, c.aggregates, func(ctx context.Context, s *schema) (drainResult, error) {
			return drainOutboxInto(ctx, func() (*gorm.DB, error) { return s.gormDB(3) }, noop, batch, n)
		})
	}}
}

// withKafka runs fn against a fresh in-process cluster.
func withKafka(fn func(addrs []string) (drainResult, error)) (drainResult, error) {
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(8, "bench"))
	if err != nil {
		return drainResult{}, fmt.Errorf("kfake: %w", err)
	}
	defer cluster.Close()
	return fn(cluster.ListenAddrs())
}

// benchMessages returns n messages like the backlog's: the customer
// aggregate, a payload of about 230 bytes.
func benchMessages(n, aggregates int) []outbox.Message {
	msgs := make([]outbox.Message, n)
	seqs := make([]int64, aggregates)
	at := time.Now().UTC()
	for i := range msgs {
		a := i % aggregates
		seqs[a]++
		payload, _ := json.Marshal(orderPayload{OrderID: uint64(i + 1), CustomerID: customerID(a), Status: "placed",
			AmountCents: 100 + int64(i%100000), Currency: "EUR", Note: orderNote, PlacedAt: at})
		id := fmt.Sprintf("bench-%d", i)
		msgs[i] = outbox.Message{EventID: id, EventType: eventType, AggregateType: aggregateType, AggregateID: customerID(a),
			Sequence: seqs[a], IdempotencyKey: id, Payload: payload, OccurredAt: at, Attempt: 1}
	}
	return msgs
}

// kafkaClientLoop produces n records as outboxkafka makes them, all
// asynchronously, and waits for every acknowledgement.
func kafkaClientLoop(ctx context.Context, addrs []string, n, aggregates int) (drainResult, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...))
	if err != nil {
		return drainResult{}, err
	}
	defer cl.Close()
	recs := make([]*kgo.Record, n)
	for i, m := range benchMessages(n, aggregates) {
		rec := &kgo.Record{Topic: "bench", Key: []byte(cloudevent.Key(m)), Value: m.Payload}
		for _, a := range cloudevent.Attributes(m, cloudevent.DefaultSource) {
			name := outboxkafka.HeaderPrefix + a.Name
			if a.Name == "datacontenttype" {
				name = outboxkafka.HeaderContentType
			}
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: name, Value: []byte(a.Value)})
		}
		recs[i] = rec
	}
	ctx, cancel := context.WithTimeout(ctx, drainTimeout(n))
	defer cancel()
	var (
		wg     sync.WaitGroup
		failed atomic.Int64
		first  atomic.Value
	)
	start := time.Now()
	for _, rec := range recs {
		wg.Add(1)
		cl.Produce(ctx, rec, func(_ *kgo.Record, err error) {
			if err != nil {
				failed.Add(1)
				first.CompareAndSwap(nil, err)
			}
			wg.Done()
		})
	}
	wg.Wait()
	res := drainResult{done: n - int(failed.Load()), elapsed: time.Since(start)}
	if err, _ := first.Load().(error); err != nil {
		if !errors.Is(err, context.DeadlineExceeded) {
			return drainResult{}, err
		}
		res.timedOut = true
	}
	return res, nil
}

// drainOutboxInto drains a backlog of n events with one outbox dispatcher
// in Run, on a *gorm.DB from open, into pub; the clock stops when Run
// returns after pub accepted the last of them.
func drainOutboxInto(ctx context.Context, open func() (*gorm.DB, error), pub outbox.Publisher, batch, n int) (drainResult, error) {
	ctx, cancel := context.WithTimeout(ctx, drainTimeout(n))
	defer cancel()
	running, stop := context.WithCancel(ctx)
	defer stop()
	var accepted atomic.Int64
	counter := outbox.PublisherFunc(func(ctx context.Context, b outbox.Batch) error {
		err := pub.Publish(ctx, b)
		ok := len(b.Messages)
		var pe *outbox.PartialError
		switch {
		case errors.As(err, &pe):
			ok -= len(pe.Failed)
		case err != nil:
			ok = 0
		}
		if accepted.Add(int64(ok)) >= int64(n) {
			stop()
		}
		return err
	})
	db, err := open()
	if err != nil {
		return drainResult{}, err
	}
	defer closeGorm(db)
	d, err := outbox.NewDispatcher(db, counter, outbox.WithBatchSize(batch), outbox.WithLogger(quietLogger))
	if err != nil {
		return drainResult{}, err
	}
	start := time.Now()
	_ = d.Run(running) // returns nil; it logs its errors
	res := drainResult{done: int(min(accepted.Load(), int64(n))), elapsed: time.Since(start)}
	if res.done < n {
		if err := ctx.Err(); err != nil && !errors.Is(err, context.DeadlineExceeded) {
			return drainResult{}, err
		}
		res.timedOut = true
	}
	return res, nil
}

// brokerTable runs a broker scenario's drains interleaved, c.repeat
// times, and prints their medians with the outbox's ratio to the slower
// of the broker's client and the raw loop (g is outbox, client, raw, then
// any others).
func brokerTable(r *report, title string, n int, c config, g []drainSpec) error {
	results, err := drainRepeated(g, c.repeat)
	if err != nil {
		return err
	}
	var rows [][]string
	rates := make([]float64, len(g))
	for i, spec := range g {
		res := median(results[i])
		rates[i] = res.rate()
		r.add(spec.name, res.rate(), "events/s")
		each := make([]string, len(results[i]))
		for k, x := range results[i] {
			each[k] = f1(x.rate())
		}
		note := ""
		if res.timedOut {
			note = "timed out, partial"
		}
		rows = append(rows, []string{spec.system, spec.config, fmt.Sprintf("%d", res.done), f1(res.rate()), strings.Join(each, " "), note})
	}
	ceiling := min(rates[1], rates[2])
	ratio := strings.TrimSuffix(g[0].name, "_outbox") + "_ratio_outbox_over_slower"
	r.add(ratio, rates[0]/ceiling, "ratio")
	rows = append(rows, []string{"outbox / slower of the two", "target ≥ 0.70", "", ratioCell(rates[0], ceiling), "", ""})
	r.table(fmt.Sprintf("%s: %d events over %d aggregates, median of %d", title, n, c.aggregates, c.repeat),
		[]string{"system", "configuration", "events", "events/s", "each", ""}, rows)
	return nil
}
