package main

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Watermill's outbox is its forwarder: services publish enveloped messages
// to a PostgreSQL table in their own transactions, and the forwarder reads
// them with the SQL subscriber and publishes each to its destination. Here
// the table holds the backlog, written as the forwarder's publisher writes
// it (an envelope naming the destination topic around the event's
// payload), in transactions of watermillLoadTx messages; the destination is
// a no-op publisher that counts.

const (
	watermillTopic  = "forwarder_topic"
	watermillLoadTx = 100
)

// countingPublisher is the forwarder's destination: it accepts and counts.
type countingPublisher struct{ n atomic.Int64 }

func (p *countingPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.n.Add(int64(len(msgs)))
	return nil
}

func (p *countingPublisher) Close() error { return nil }

// runWatermill drains the backlog with one forwarder whose subscriber reads
// batch messages per query (0: Watermill's default, 100).
func runWatermill(ctx context.Context, e *env, c config, batch int) (drainResult, error) {
	label := "watermill"
	s, err := e.newSchema(ctx, label)
	if err != nil {
		return drainResult{}, err
	}
	defer s.drop()
	pool, err := s.pgxPool(ctx, 4)
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()

	logger := watermill.NopLogger{}
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromPgx(pool), wsql.SubscriberConfig{
		SchemaAdapter:    wsql.DefaultPostgreSQLSchema{SubscribeBatchSize: batch},
		OffsetsAdapter:   wsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
	}, logger)
	if err != nil {
		return drainResult{}, err
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(watermillTopic); err != nil {
		return drainResult{}, fmt.Errorf("initialize schema: %w", err)
	}
	table := wsql.DefaultPostgreSQLSchema{}.MessagesTable(watermillTopic)

	// Load: each transaction inserts watermillLoadTx envelopes, as that many
	// services' transactions would have, so that transaction ids vary.
	base := time.Now().Add(-time.Hour).UTC()
	for done := 0; done < c.backlog; done += watermillLoadTx {
		k := min(watermillLoadTx, c.backlog-done)
		if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (uuid, payload, metadata, transaction_id)
SELECT gen_random_uuid()::text,
	json_build_object('destination_topic', 'orders', 'uuid', gen_random_uuid()::text, 'metadata', json_build_object(),
		'payload', translate(encode(convert_to(json_build_object('order_id', g, 'customer_id', agg, 'status', 'placed',
			'amount_cents', 100 + g % 100000, 'currency', 'EUR', 'note', $4::text,
			'placed_at', $3::timestamptz + g * interval '1 microsecond')::text, 'UTF8'), 'base64'), E'\n', '')),
	'{}'::json, pg_current_xact_id()
FROM (SELECT g, 'customer-' || lpad(floor(random() * $5)::int::text, 6, '0') AS agg
	FROM generate_series($1::int, $2::int) AS g) AS src
ORDER BY g`, done+1, done+k, base, orderNote, c.aggregates); err != nil {
			return drainResult{}, fmt.Errorf("load: %w", err)
		}
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+table); err != nil {
		return drainResult{}, err
	}
	e.forceCheckpoint(ctx)

	dest := &countingPublisher{}
	fwd, err := forwarder.NewForwarder(sub, dest, logger, forwarder.Config{ForwarderTopic: watermillTopic, CloseTimeout: 10 * time.Second})
	if err != nil {
		return drainResult{}, err
	}
	runCtx, cancel := context.WithTimeout(ctx, drainTimeout(c.backlog))
	defer cancel()
	start := time.Now()
	runErr := make(chan error, 1)
	go func() { runErr <- fwd.Run(runCtx) }()
	defer func() {
		_ = fwd.Close()
		<-runErr
	}()

	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for dest.n.Load() < int64(c.backlog) {
		select {
		case <-tick.C:
		case err := <-runErr:
			runErr <- err // for the deferred wait
			return drainResult{}, fmt.Errorf("forwarder stopped after %d messages: %v", dest.n.Load(), err)
		case <-runCtx.Done():
			if ctx.Err() != nil {
				return drainResult{}, ctx.Err()
			}
			return drainResult{done: int(dest.n.Load()), elapsed: time.Since(start), timedOut: true}, nil
		}
	}
	return drainResult{done: int(dest.n.Load()), elapsed: time.Since(start)}, nil
}
