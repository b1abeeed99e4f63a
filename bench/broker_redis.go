package main

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"time"

	"github.com/redis/go-redis/v9"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/cloudevent"
	"github.com/gorm-outbox/outbox/outboxredis"
)

// The redis scenario: events per second from a backlog on PostgreSQL
// through one outbox dispatcher and outboxredis into a Redis stream (the
// server at OUTBOX_REDIS_ADDR, default 127.0.0.1:6379), next to go-redis
// adding the same entries in pipelines of the batch size in a loop (the
// broker's ceiling on this machine), the raw-SQL loop with a no-op
// publisher, and the dispatcher into a no-op publisher. Each drain writes a
// fresh stream, deleted after it; the four run interleaved, c.repeat
// times, and each figure is the median. Without
// a server the scenario is skipped with a note, except under CI=true.

func redisBenchAddr() string {
	if a := os.Getenv("OUTBOX_REDIS_ADDR"); a != "" {
		return a
	}
	return "127.0.0.1:6379"
}

func runRedis(ctx context.Context, e *env, c config, r *report) error {
	rdb := redis.NewClient(&redis.Options{Addr: redisBenchAddr(), ContextTimeoutEnabled: true})
	defer rdb.Close()
	pingCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
	err := rdb.Ping(pingCtx).Err()
	cancel()
	if err != nil {
		if os.Getenv("CI") == "true" {
			return fmt.Errorf("no Redis server at %s (CI=true): %w", redisBenchAddr(), err)
		}
		r.note("redis: skipped, no server at %s (set OUTBOX_REDIS_ADDR): %v", redisBenchAddr(), err)
		return nil
	}
	n, batch := brokerBacklog(c), kafkaRedisBatch(c)
	var drains int
	// stream returns a fresh stream key, deleted when the drain is over.
	stream := func() (string, func()) {
		drains++
		key := fmt.Sprintf("outbox-bench:%d:%d", os.Getpid(), drains)
		return key, func() { rdb.Del(context.Background(), key) }
	}
	g := []drainSpec{
		{"outbox → outboxredis", fmt.Sprintf("1 dispatcher, batch %d", batch), "broker_redis_outbox", func() (drainResult, error) {
			key, done := stream()
			defer done()
			pub, err := outboxredis.New(rdb, outboxredis.WithStream(func(outbox.Message) string { return key }))
			if err != nil {
				return drainResult{}, err
			}
			return pgOutboxDrain(ctx, e, "redis", n, c.aggregates, func(ctx context.Context, s *schema) (drainResult, error) {
				return drainOutboxInto(ctx, func() (*gorm.DB, error) { return s.gormDB(3) }, pub, batch, n)
			})
		}},
		{"go-redis alone", fmt.Sprintf("pipelines of %d XADD", batch), "broker_redis_client", func() (drainResult, error) {
			key, done := stream()
			defer done()
			return redisClientLoop(ctx, rdb, key, n, batch, c.aggregates)
		}},
		{"raw SQL loop", fmt.Sprintf("1 worker, batch %d, no-op publisher", batch), "broker_redis_raw", func() (drainResult, error) {
			return pgOutboxDrain(ctx, e, "redis_raw", n, c.aggregates, func(ctx context.Context, s *schema) (drainResult, error) {
				return drainRaw(ctx, func() (*sql.DB, error) { return s.sqlDB(2) }, rawPostgres, 1, batch, n)
			})
		}},
		outboxNoop(ctx, e, c, "redis"),
	}
	return brokerTable(r, "redis streams ("+redisBenchAddr()+")", n, c, g)
}

// redisClientLoop adds n entries, with the fields outboxredis writes, in
// pipelines of batch XADD commands one after another.
func redisClientLoop(ctx context.Context, rdb *redis.Client, key string, n, batch, aggregates int) (drainResult, error) {
	msgs := benchMessages(n, aggregates)
	args := make([]*redis.XAddArgs, n)
	for i, m := range msgs {
		var values []any
		for _, a := range cloudevent.Attributes(m, cloudevent.DefaultSource) {
			values = append(values, a.Name, a.Value)
		}
		args[i] = &redis.XAddArgs{Stream: key, Values: append(values, outboxredis.FieldData, []byte(m.Payload))}
	}
	ctx, cancel := context.WithTimeout(ctx, drainTimeout(n))
	defer cancel()
	start := time.Now()
	for lo := 0; lo < n; lo += batch {
		pipe := rdb.Pipeline()
		for _, a := range args[lo:min(lo+batch, n)] {
			pipe.XAdd(ctx, a)
		}
		if _, err := pipe.Exec(ctx); err != nil {
			return drainResult{}, fmt.Errorf("go-redis pipeline: %w", err)
		}
	}
	return drainResult{done: n, elapsed: time.Since(start)}, nil
}
