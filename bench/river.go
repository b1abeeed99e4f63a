package main

import (
	"context"
	"fmt"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

// River drains the same kind of backlog as jobs: one job per event, with
// the event's payload as its arguments, inserted transactionally in
// batches before the clock starts, worked by no-op workers. The client is
// tuned as River's own benchmark tunes it for throughput (a short fetch
// cooldown and poll interval, many workers); the figure counts a job once
// River reports it completed, that is, after its completion is stored.

const (
	riverWorkers     = 2000
	riverInsertBatch = 5000
)

// riverOrderArgs is the job: the order event's payload.
type riverOrderArgs struct {
	orderPayload
}

func (riverOrderArgs) Kind() string { return "customer_order_placed" }

type riverNoopWorker struct {
	river.WorkerDefaults[riverOrderArgs]
}

func (riverNoopWorker) Work(context.Context, *river.Job[riverOrderArgs]) error { return nil }

func runRiver(ctx context.Context, e *env, c config) (drainResult, error) {
	s, err := e.newSchema(ctx, "river")
	if err != nil {
		return drainResult{}, err
	}
	defer s.drop()
	pool, err := s.pgxPool(ctx, 10)
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()
	driver := riverpgxv5.New(pool)

	migrator, err := rivermigrate.New(driver, &rivermigrate.Config{Logger: quietLogger})
	if err != nil {
		return drainResult{}, err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return drainResult{}, fmt.Errorf("migrate: %w", err)
	}

	workers := river.NewWorkers()
	if err := river.AddWorkerSafely(workers, riverNoopWorker{}); err != nil {
		return drainResult{}, err
	}

	// Load with an insert-only client, in transactions of riverInsertBatch
	// jobs.
	inserter, err := river.NewClient(driver, &river.Config{Workers: workers, Logger: quietLogger})
	if err != nil {
		return drainResult{}, err
	}
	base := time.Now().Add(-time.Hour).UTC()
	for done := 0; done < c.backlog; {
		k := min(riverInsertBatch, c.backlog-done)
		params := make([]river.InsertManyParams, k)
		for i := range params {
			n := done + i
			params[i].Args = riverOrderArgs{orderPayload{
				OrderID: uint64(n + 1), CustomerID: customerID(n % c.aggregates), Status: "placed",
				AmountCents: 100 + int64(n%100000), Currency: "EUR", Note: orderNote,
				PlacedAt: base.Add(time.Duration(n) * time.Microsecond),
			}}
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			return drainResult{}, err
		}
		if _, err := inserter.InsertManyFastTx(ctx, tx, params); err != nil {
			_ = tx.Rollback(ctx)
			return drainResult{}, fmt.Errorf("insert jobs: %w", err)
		}
		if err := tx.Commit(ctx); err != nil {
			return drainResult{}, err
		}
		done += k
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE river_job`); err != nil {
		return drainResult{}, err
	}
	e.forceCheckpoint(ctx)

	client, err := river.NewClient(driver, &river.Config{
		FetchCooldown:     2 * time.Millisecond,
		FetchPollInterval: 20 * time.Millisecond,
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: riverWorkers}},
		Workers:           workers,
		Logger:            quietLogger,
	})
	if err != nil {
		return drainResult{}, err
	}
	events, cancelSub := client.SubscribeConfig(&river.SubscribeConfig{
		ChanSize: c.backlog + 1000,
		Kinds:    []river.EventKind{river.EventKindJobCompleted, river.EventKindJobFailed, river.EventKindJobCancelled},
	})
	defer cancelSub()

	runCtx, cancel := context.WithTimeout(ctx, drainTimeout(c.backlog))
	defer cancel()
	start := time.Now()
	if err := client.Start(runCtx); err != nil {
		return drainResult{}, fmt.Errorf("start: %w", err)
	}
	defer func() {
		stopCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = client.Stop(stopCtx)
	}()

	completed, failed := 0, 0
	for completed+failed < c.backlog {
		select {
		case ev, ok := <-events:
			if !ok {
				return drainResult{}, fmt.Errorf("subscription closed after %d jobs", completed)
			}
			if ev.Kind == river.EventKindJobCompleted {
				completed++
			} else {
				failed++
			}
		case <-runCtx.Done():
			if ctx.Err() != nil {
				return drainResult{}, ctx.Err()
			}
			return drainResult{done: completed, elapsed: time.Since(start), timedOut: true}, nil
		}
	}
	elapsed := time.Since(start)
	if failed > 0 {
		return drainResult{}, fmt.Errorf("%d jobs failed or were cancelled", failed)
	}
	return drainResult{done: completed, elapsed: elapsed}, nil
}
