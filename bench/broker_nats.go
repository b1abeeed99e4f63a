package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/cloudevent"
	"github.com/gorm-outbox/outbox/outboxnats"
)

// The broker scenarios (nats here, amqp in broker_amqp.go): events per
// second from a PostgreSQL backlog through one outbox dispatcher (batch
// brokerBatch) and the broker's publisher package into a real broker, next
// to the broker's own client publishing the same number of messages of the
// same size and headers asynchronously in a loop: the broker's ceiling on
// this machine. The two drains are interleaved, repeat times, and each
// figure is their median. Where the dispatch scenario measured the raw-SQL
// loop at the same batch, the outbox is also set against the slower of
// that loop and the client.

const brokerBatch = 1000

// brokerMessages returns n messages like the backlog's: aggregates
// customers, sequences counting per customer, payloads of the same shape.
func brokerMessages(n, aggregates int) []outbox.Message {
	rnd := rand.New(rand.NewPCG(3, 4))
	seqs := make([]int64, aggregates)
	base := time.Now().UTC()
	out := make([]outbox.Message, n)
	for i := range out {
		a := rnd.IntN(aggregates)
		seqs[a]++
		o := benchOrder{ID: uint64(i + 1), CustomerID: customerID(a), Status: "placed",
			AmountCents: 100 + int64(i%100000), Currency: "EUR", Note: orderNote, CreatedAt: base}
		payload, _ := json.Marshal(o.payload())
		id := uuid.Must(uuid.NewV7()).String()
		out[i] = outbox.Message{EventID: id, EventType: eventType, AggregateType: aggregateType,
			AggregateID: o.CustomerID, Sequence: seqs[a], IdempotencyKey: id, Payload: payload,
			OccurredAt: base, Attempt: 1}
	}
	return out
}

// brokerUnavailable reports a broker that does not answer: under CI=true
// an error, elsewhere a note, and the scenario is skipped.
func brokerUnavailable(r *report, what, addr, env string, err error) error {
	if os.Getenv("CI") == "true" {
		return fmt.Errorf("%s at %q does not answer: %w", what, addr, err)
	}
	r.note("skipped: no %s at %q (set %s): %v", what, addr, env, err)
	return nil
}

// drainToBroker drains the backlog with one outbox dispatcher in Run,
// publishing through pub; the clock stops when Run returns after pub
// accepted the last of n events.
func drainToBroker(ctx context.Context, open func() (*gorm.DB, error), pub outbox.Publisher, n int) (drainResult, error) {
	ctx, cancel := context.WithTimeout(ctx, drainTimeout(n))
	defer cancel()
	running, stop := context.WithCancel(ctx)
	defer stop()
	var accepted atomic.Int64
	counted := outbox.PublisherFunc(func(ctx context.Context, b outbox.Batch) error {
		err := pub.Publish(ctx, b)
		ok := len(b.Messages)
		var pe *outbox.PartialError
		if errors.As(err, &pe) {
			ok -= len(pe.Failed)
		} else if err != nil {
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
	d, err := outbox.NewDispatcher(db, counted, outbox.WithBatchSize(brokerBatch), outbox.WithLogger(quietLogger))
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

// brokerReport prints the scenario's table and records its figures:
// <prefix>_outbox_b1000, <prefix>_client_async and their ratio, and the
// ratio to the slower of the client and the raw-SQL loop when the dispatch
// scenario measured it.
func brokerReport(r *report, prefix, title string, specs []drainSpec, results [][]drainResult) {
	var rows [][]string
	for i, spec := range specs {
		m := median(results[i])
		r.add(spec.name, m.rate(), "events/s")
		note := ""
		if m.timedOut {
			note = "timed out, partial"
		}
		rows = append(rows, []string{spec.system, spec.config, m.elapsed.Round(time.Millisecond).String(), f1(m.rate()), note})
	}
	outboxName, clientName := specs[0].name, specs[1].name
	r.ratio(prefix+"_ratio_outbox_over_client", outboxName, clientName)
	if v, ok := r.get(prefix + "_ratio_outbox_over_client"); ok {
		rows = append(rows, []string{"outbox / client", "", "", f2(v), ""})
	}
	raw := fmt.Sprintf("dispatch_raw_1d_b%d", brokerBatch)
	if rawRate, ok := r.get(raw); ok {
		client, _ := r.get(clientName)
		floor := raw
		if client < rawRate {
			floor = clientName
		}
		r.ratio(prefix+"_ratio_outbox_over_slower", outboxName, floor)
		if v, ok := r.get(prefix + "_ratio_outbox_over_slower"); ok {
			rows = append(rows, []string{"outbox / slower of client and " + raw, "", "", f2(v), ""})
		}
	}
	r.table(title, []string{"system", "configuration", "time (median)", "events/s", ""}, rows)
}

func natsBenchURL() string {
	if u := os.Getenv("OUTBOX_NATS_URL"); u != "" {
		return u
	}
	return nats.DefaultURL
}

func runBrokerNATS(ctx context.Context, e *env, c config, r *report) error {
	nc, err := nats.Connect(natsBenchURL(), nats.Timeout(3*time.Second))
	if err != nil {
		return brokerUnavailable(r, "NATS server", natsBenchURL(), "OUTBOX_NATS_URL", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	name := fmt.Sprintf("BENCH_%d", os.Getpid())
	prefix := strings.ToLower(name)
	subject := func(m outbox.Message) string { return prefix + "." + m.AggregateType }
	// A fresh stream per drain, so that each starts from the same state and
	// the duplicate window holds only its own ids.
	fresh := func() error {
		_ = js.DeleteStream(ctx, name)
		_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{prefix + ".>"}, Duplicates: time.Minute})
		return err
	}
	defer js.DeleteStream(context.WithoutCancel(ctx), name)
	pub, err := outboxnats.New(js, outboxnats.WithSubject(subject))
	if err != nil {
		return err
	}
	msgs := brokerMessages(c.backlog, c.aggregates)
	cfg := fmt.Sprintf("1 dispatcher, batch %d", brokerBatch)
	specs := []drainSpec{
		{"outbox → outboxnats", cfg, fmt.Sprintf("nats_outbox_b%d", brokerBatch), func() (drainResult, error) {
			if err := fresh(); err != nil {
				return drainResult{}, err
			}
			return pgOutboxDrain(ctx, e, "nats", c.backlog, c.aggregates, func(ctx context.Context, s *schema) (drainResult, error) {
				return drainToBroker(ctx, func() (*gorm.DB, error) { return s.gormDB(2) }, pub, c.backlog)
			})
		}},
		{"nats.go PublishMsgAsync loop", "same messages, same headers", "nats_client_async", func() (drainResult, error) {
			if err := fresh(); err != nil {
				return drainResult{}, err
			}
			return natsClientLoop(ctx, js, subject, msgs)
		}},
	}
	results, err := drainRepeated(specs, c.repeat)
	if err != nil {
		return err
	}
	brokerReport(r, "nats", fmt.Sprintf("NATS JetStream: %d events from a backlog, %d aggregates, median of %d", c.backlog, c.aggregates, c.repeat), specs, results)
	return nil
}

// natsClientLoop publishes msgs with nats.go alone, asynchronously, with
// the headers outboxnats would set, and waits for every ack.
func natsClientLoop(ctx context.Context, js jetstream.JetStream, subject func(outbox.Message) string, msgs []outbox.Message) (drainResult, error) {
	ctx, cancel := context.WithTimeout(ctx, drainTimeout(len(msgs)))
	defer cancel()
	start := time.Now()
	for _, m := range msgs {
		h := nats.Header{}
		for _, a := range cloudevent.Attributes(m, "") {
			h["ce-"+a.Name] = []string{a.Value}
		}
		if _, err := js.PublishMsgAsync(&nats.Msg{Subject: subject(m), Header: h, Data: m.Payload}, jetstream.WithMsgID(m.EventID)); err != nil {
			return drainResult{}, err
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-ctx.Done():
		return drainResult{done: len(msgs) - js.PublishAsyncPending(), elapsed: time.Since(start), timedOut: true}, nil
	}
	return drainResult{done: len(msgs), elapsed: time.Since(start)}, nil
}
