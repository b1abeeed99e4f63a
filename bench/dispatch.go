package main

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
)

// The dispatch scenario: events per second drained from a backlog of
// pending events by
//
//   - the outbox dispatcher: 1 and 4 dispatchers, each with a *gorm.DB of
//     its own, each in Dispatcher.Run, batch sizes 100 and 1,000,
//     per-aggregate ordering on (the library has no way to turn it off);
//   - a raw-SQL loop on the same table and index: claim with FOR UPDATE
//     SKIP LOCKED in index order (next_attempt_at, id) and lease, then
//     settle by id in a second statement, with no ordering per aggregate;
//   - River (river.go) and Watermill's SQL forwarder (watermill.go);
//   - on SQLite, one outbox dispatcher and the raw loop.
//
// Every run gets a fresh schema, a freshly loaded backlog, VACUUM ANALYZE
// and a checkpoint before the clock starts, and a no-op publisher.

func runDispatch(ctx context.Context, e *env, c config, r *report) error {
	var groups [][]drainSpec
	if c.want("outbox") || c.want("raw") {
		for _, batch := range c.batchSizes {
			for _, n := range c.dispatchers {
				cfg := fmt.Sprintf("%d dispatcher(s), batch %d", n, batch)
				suffix := fmt.Sprintf("%dd_b%d", n, batch)
				var g []drainSpec
				if c.want("outbox") {
					g = append(g, drainSpec{"outbox", cfg, "dispatch_outbox_" + suffix, func() (drainResult, error) {
						return pgDrain(ctx, e, c, "outbox", func(ctx context.Context, s *schema) (drainResult, error) {
							// Three connections: claims, the listener, the slot locks.
							return drainOutbox(ctx, func() (*gorm.DB, error) { return s.gormDB(3) }, n, batch, c.backlog)
						})
					}})
				}
				if c.want("raw") {
					g = append(g, drainSpec{"raw SQL loop", cfg, "dispatch_raw_" + suffix, func() (drainResult, error) {
						return pgDrain(ctx, e, c, "raw", func(ctx context.Context, s *schema) (drainResult, error) {
							return drainRaw(ctx, func() (*sql.DB, error) { return s.sqlDB(2) }, rawPostgres, n, batch, c.backlog)
						})
					}}, drainSpec{"raw SQL loop, synchronous_commit off", cfg, "dispatch_raw_async_" + suffix, func() (drainResult, error) {
						// Like for like: the library's claims and settles
						// commit with synchronous_commit off.
						return pgDrain(ctx, e, c, "raw_async", func(ctx context.Context, s *schema) (drainResult, error) {
							return drainRaw(ctx, func() (*sql.DB, error) { return s.sqlDBAsync(2) }, rawPostgres, n, batch, c.backlog)
						})
					}})
				}
				groups = append(groups, g)
			}
		}
	}
	if c.want("river") {
		groups = append(groups, []drainSpec{{"River", fmt.Sprintf("1 client, %d workers", riverWorkers), "dispatch_river", func() (drainResult, error) {
			return retry(ctx, e, "river", func() (drainResult, error) { return runRiver(ctx, e, c) })
		}}})
	}
	if c.want("watermill") {
		var g []drainSpec
		for _, batch := range []int{0, 1000} {
			cfg, name := "forwarder, defaults (batch 100)", "dispatch_watermill_default"
			if batch != 0 {
				cfg, name = fmt.Sprintf("forwarder, batch %d", batch), fmt.Sprintf("dispatch_watermill_b%d", batch)
			}
			g = append(g, drainSpec{"Watermill", cfg, name, func() (drainResult, error) {
				return retry(ctx, e, "watermill", func() (drainResult, error) { return runWatermill(ctx, e, c, batch) })
			}})
		}
		groups = append(groups, g)
	}
	if c.sqlite && c.want("sqlite") {
		var g []drainSpec
		for _, batch := range c.batchSizes {
			g = append(g, drainSpec{"outbox, SQLite", fmt.Sprintf("1 dispatcher, batch %d", batch), fmt.Sprintf("dispatch_sqlite_outbox_1d_b%d", batch), func() (drainResult, error) {
				return sqliteDrain(ctx, e, c, func(ctx context.Context, dsn string) (drainResult, error) {
					return drainOutbox(ctx, func() (*gorm.DB, error) { return sqliteGorm(dsn, 1) }, 1, batch, c.backlog)
				})
			}})
		}
		batch := c.batchSizes[len(c.batchSizes)-1]
		g = append(g, drainSpec{"raw SQL loop, SQLite", fmt.Sprintf("1 worker, batch %d", batch), fmt.Sprintf("dispatch_sqlite_raw_1d_b%d", batch), func() (drainResult, error) {
			return sqliteDrain(ctx, e, c, func(ctx context.Context, dsn string) (drainResult, error) {
				return drainRaw(ctx, func() (*sql.DB, error) { return sqliteSQL(dsn) }, rawSQLite, 1, batch, c.backlog)
			})
		}})
		groups = append(groups, g)
	}

	var rows, work [][]string
	for _, g := range groups {
		results, err := drainRepeated(g, c.repeat)
		if err != nil {
			return err
		}
		for i, spec := range g {
			res := median(results[i])
			r.add(spec.name, res.rate(), "events/s")
			rates := make([]string, len(results[i]))
			for k, x := range results[i] {
				rates[k] = f1(x.rate())
			}
			note := ""
			if res.timedOut {
				note = "timed out, partial"
			}
			rows = append(rows, []string{spec.system, spec.config, fmt.Sprintf("%d", res.done), res.elapsed.Round(time.Millisecond).String(), f1(res.rate()), strings.Join(rates, " "), note})
			work = append(work, workRow(spec.system, spec.config, results[i]))
			r.note("  %s, %s: median of %d drains %.1f events/s (each: %s) %s", spec.system, spec.config, len(rates), res.rate(), strings.Join(rates, ", "), note)
		}
	}
	r.table(fmt.Sprintf("dispatch throughput, backlog of %d events over %d aggregates, no-op publisher, median of %d drains", c.backlog, c.aggregates, c.repeat),
		[]string{"system", "configuration", "events", "time", "events/s", "each drain", ""}, rows)
	r.table(fmt.Sprintf("dispatch work asked of the server, median of %d drains (work.go says how each is counted; WAL is the whole server's)", c.repeat),
		workHeader, work)
	dispatchRatios(c, r)
	return nil
}

// drainSpec is one system's drain in one configuration, and the name of
// its figure.
type drainSpec struct {
	system, config, name string
	drain                func() (drainResult, error)
}

// drainRepeated runs every drain of a group repeat times, interleaved
// (a, b, c, a, b, c, ...), so that a slow spell of the machine falls on
// all of them rather than on one; it returns each drain's results.
func drainRepeated(g []drainSpec, repeat int) ([][]drainResult, error) {
	results := make([][]drainResult, len(g))
	for range repeat {
		for i, spec := range g {
			res, err := spec.drain()
			if err != nil {
				return nil, fmt.Errorf("%s, %s: %w", spec.system, spec.config, err)
			}
			results[i] = append(results[i], res)
		}
	}
	return results, nil
}

// median returns the result with the median rate (the lower of the two
// middle ones for an even count).
func median(rs []drainResult) drainResult {
	sorted := slices.Clone(rs)
	slices.SortFunc(sorted, func(a, b drainResult) int { return cmp.Compare(a.rate(), b.rate()) })
	return sorted[(len(sorted)-1)/2]
}

// dispatchRatios records the outbox against each peer: against the raw
// loop configuration by configuration, and its best configuration against
// River and Watermill.
func dispatchRatios(c config, r *report) {
	var lines [][]string
	best, bestName := 0.0, ""
	for _, batch := range c.batchSizes {
		for _, n := range c.dispatchers {
			suffix := fmt.Sprintf("%dd_b%d", n, batch)
			name := "dispatch_ratio_outbox_over_raw_" + suffix
			r.ratio(name, "dispatch_outbox_"+suffix, "dispatch_raw_"+suffix)
			if v, ok := r.get(name); ok {
				lines = append(lines, []string{"outbox / raw SQL loop, " + suffix, f2(v)})
			}
			name = "dispatch_ratio_outbox_over_raw_async_" + suffix
			r.ratio(name, "dispatch_outbox_"+suffix, "dispatch_raw_async_"+suffix)
			if v, ok := r.get(name); ok {
				lines = append(lines, []string{"outbox / raw SQL loop with synchronous_commit off, " + suffix, f2(v)})
			}
			if v, ok := r.get("dispatch_outbox_" + suffix); ok && v > best {
				best, bestName = v, "dispatch_outbox_"+suffix
			}
		}
	}
	if bestName != "" {
		for _, peer := range []string{"river", "watermill_default", "watermill_b1000"} {
			name := "dispatch_ratio_outbox_best_over_" + peer
			r.ratio(name, bestName, "dispatch_"+peer)
			if v, ok := r.get(name); ok {
				lines = append(lines, []string{fmt.Sprintf("outbox best (%s) / %s", strings.TrimPrefix(bestName, "dispatch_outbox_"), peer), f2(v)})
			}
		}
	}
	if len(lines) > 0 {
		r.table("dispatch ratios", []string{"ratio", "value"}, lines)
	}
}

// drainResult is how long a drain took and how much it moved, in how
// many batches, and, where measured, the work it asked of the server.
type drainResult struct {
	done     int
	batches  int
	elapsed  time.Duration
	timedOut bool
	work     *serverWork
}

func (d drainResult) rate() float64 { return rate(d.done, d.elapsed) }

// drainTimeout bounds one drain, so that a system that has collapsed ends
// its measurement instead of the run: past 30s plus a millisecond per
// event (a rate of 1,000 events/s), the drain stops and its figure is the
// rate so far, marked "timed out, partial".
func drainTimeout(n int) time.Duration {
	return 30*time.Second + time.Duration(n)*time.Millisecond
}

// drainLoop runs step on workers goroutines until the steps together have
// moved total events or the drain times out. A step that moved nothing
// backs off for a millisecond.
func drainLoop(ctx context.Context, workers, total int, step func(ctx context.Context, worker int) (int, error)) (drainResult, error) {
	ctx, cancel := context.WithTimeout(ctx, drainTimeout(total))
	defer cancel()
	var (
		moved    atomic.Int64
		wg       sync.WaitGroup
		errOnce  sync.Once
		firstErr error
		doneAt   atomic.Int64
		batches  atomic.Int64
	)
	start := time.Now()
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil && moved.Load() < int64(total) {
				k, err := step(ctx, w)
				if err != nil {
					if ctx.Err() == nil {
						errOnce.Do(func() { firstErr = err; cancel() })
					}
					return
				}
				if k > 0 {
					batches.Add(1)
				}
				if moved.Add(int64(k)) >= int64(total) {
					doneAt.CompareAndSwap(0, int64(time.Since(start)))
					return
				}
				if k == 0 {
					select {
					case <-ctx.Done():
					case <-time.After(time.Millisecond):
					}
				}
			}
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return drainResult{}, firstErr
	}
	res := drainResult{done: int(moved.Load()), batches: int(batches.Load()), elapsed: time.Duration(doneAt.Load())}
	if res.elapsed == 0 {
		if err := ctx.Err(); err != nil && !errors.Is(err, context.DeadlineExceeded) {
			return drainResult{}, err
		}
		res.elapsed, res.timedOut = time.Since(start), true
	}
	return res, nil
}

// pgDrain loads a backlog into the outbox table of a fresh schema and
// drains it with fn.
func pgDrain(ctx context.Context, e *env, c config, label string, fn func(context.Context, *schema) (drainResult, error)) (drainResult, error) {
	return pgOutboxDrain(ctx, e, label, c.backlog, c.aggregates, fn)
}

func pgOutboxDrain(ctx context.Context, e *env, label string, n, aggregates int, fn func(context.Context, *schema) (drainResult, error)) (drainResult, error) {
	return retry(ctx, e, fmt.Sprintf("%s drain of %d", label, n), func() (drainResult, error) {
		return pgOutboxDrainOnce(ctx, e, label, n, aggregates, fn)
	})
}

func pgOutboxDrainOnce(ctx context.Context, e *env, label string, n, aggregates int, fn func(context.Context, *schema) (drainResult, error)) (drainResult, error) {
	s, err := e.newSchema(ctx, label)
	if err != nil {
		return drainResult{}, err
	}
	defer s.drop()
	db, err := s.gormDB(2)
	if err != nil {
		return drainResult{}, err
	}
	defer closeGorm(db)
	if err := outbox.AutoMigrate(db.WithContext(ctx)); err != nil {
		return drainResult{}, fmt.Errorf("migrate outbox: %w", err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		return drainResult{}, err
	}
	if err := loadOutboxPostgres(ctx, sqlDB, n, aggregates); err != nil {
		return drainResult{}, fmt.Errorf("load backlog: %w", err)
	}
	if err := e.settle(ctx, sqlDB, "outbox_records", "outbox_records_sequences"); err != nil {
		return drainResult{}, err
	}
	return drainChecked(ctx, sqlDB, func() (drainResult, error) {
		return measureWork(ctx, s, sqlDB, func() (drainResult, error) { return fn(ctx, s) })
	})
}

// sqliteDrain loads a backlog into the outbox table of a fresh SQLite file
// and drains it with fn.
func sqliteDrain(ctx context.Context, e *env, c config, fn func(context.Context, string) (drainResult, error)) (drainResult, error) {
	dsn := e.sqliteFile("dispatch")
	defer removeSQLite(dsn)
	db, err := sqliteGorm(dsn, 1)
	if err != nil {
		return drainResult{}, err
	}
	defer closeGorm(db)
	if err := outbox.AutoMigrate(db.WithContext(ctx)); err != nil {
		return drainResult{}, fmt.Errorf("migrate outbox: %w", err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		return drainResult{}, err
	}
	if err := loadOutboxSQLite(ctx, sqlDB, c.backlog, c.aggregates); err != nil {
		return drainResult{}, fmt.Errorf("load backlog: %w", err)
	}
	if _, err := sqlDB.ExecContext(ctx, `ANALYZE`); err != nil {
		return drainResult{}, err
	}
	return drainChecked(ctx, sqlDB, func() (drainResult, error) { return fn(ctx, dsn) })
}

// drainChecked runs drain and, unless it timed out, checks that it left
// nothing undelivered in db.
func drainChecked(ctx context.Context, db *sql.DB, drain func() (drainResult, error)) (drainResult, error) {
	res, err := drain()
	if err != nil {
		return drainResult{}, err
	}
	if !res.timedOut {
		if err := checkDrained(ctx, db); err != nil {
			return drainResult{}, err
		}
	}
	return res, nil
}

// checkDrained fails unless every row of the backlog is delivered.
func checkDrained(ctx context.Context, db *sql.DB) error {
	var left int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM outbox_records WHERE delivery_state <> 'delivered'`).Scan(&left); err != nil {
		return err
	}
	if left != 0 {
		return fmt.Errorf("%d rows not delivered after the drain", left)
	}
	return nil
}

// loadOutboxPostgres inserts n pending events straight into the outbox
// table, in one statement: each event belongs to a random one of the
// aggregates, sequences count 1, 2, 3, ... per aggregate in id order,
// payloads are about 230 bytes, next_attempt_at rises with id, as if the
// events had been written one after another an hour ago, and event ids
// (which are also the idempotency keys) are UUIDv7 of that time, as the
// library writes them: time-ordered, so that rows claimed together have
// neighbouring keys in the unique indexes, as they do in a real outbox.
// The sequence table is filled to match.
func loadOutboxPostgres(ctx context.Context, db *sql.DB, n, aggregates int) error {
	base := time.Now().Add(-time.Hour).UTC()
	if _, err := db.ExecContext(ctx, `INSERT INTO outbox_records (event_id, event_type, aggregate_type, aggregate_id,
	aggregate_sequence, idempotency_key, payload, delivery_state, delivery_attempts, next_attempt_at,
	occurred_at, created_at, updated_at)
SELECT eid, $3, $4, agg, row_number() OVER (PARTITION BY agg ORDER BY g), eid,
	jsonb_build_object('order_id', g, 'customer_id', agg, 'status', 'placed',
		'amount_cents', 100 + g % 100000, 'currency', 'EUR', 'note', $5::text, 'placed_at', at),
	'pending', 0, at, at, at, at
FROM (
	SELECT g, agg, at,
		substr(ms, 1, 8) || '-' || substr(ms, 9, 4) || '-7' || lpad(to_hex(us % 1000), 3, '0') ||
			'-8' || substr(rnd, 1, 3) || '-' || substr(rnd, 4, 12) AS eid
	FROM (
		SELECT g, agg, at, us, lpad(to_hex(us / 1000), 12, '0') AS ms, md5(random()::text) AS rnd
		FROM (
			SELECT g, 'customer-' || lpad(floor(random() * $2)::int::text, 6, '0') AS agg, at,
				floor(extract(epoch FROM at) * 1000000)::bigint AS us
			FROM (
				SELECT g, $6::timestamptz + g * interval '1 microsecond' AS at
				FROM generate_series(1, $1::int) AS g
			) AS t
		) AS a
	) AS b
) AS src
ORDER BY g`, n, aggregates, eventType, aggregateType, orderNote, base); err != nil {
		return err
	}
	_, err := db.ExecContext(ctx, `INSERT INTO outbox_records_sequences (aggregate_type, aggregate_id, last_sequence)
SELECT aggregate_type, aggregate_id, max(aggregate_sequence) FROM outbox_records GROUP BY 1, 2`)
	return err
}

// loadOutboxSQLite inserts the same kind of backlog as loadOutboxPostgres
// into a SQLite outbox table, from Go in one transaction.
func loadOutboxSQLite(ctx context.Context, db *sql.DB, n, aggregates int) error {
	rnd := rand.New(rand.NewPCG(1, 2))
	seqs := make([]int64, aggregates)
	base := time.Now().Add(-time.Hour).UTC()
	return inTx(ctx, db, func(tx *sql.Tx) error {
		stmt, err := tx.PrepareContext(ctx, `INSERT INTO outbox_records (event_id, event_type, aggregate_type,
	aggregate_id, aggregate_sequence, idempotency_key, payload, delivery_state, delivery_attempts,
	next_attempt_at, occurred_at, created_at, updated_at)
VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', 0, ?, ?, ?, ?)`)
		if err != nil {
			return err
		}
		defer stmt.Close()
		for i := range n {
			a := rnd.IntN(aggregates)
			seqs[a]++
			o := benchOrder{ID: uint64(i + 1), CustomerID: customerID(a), Status: "placed",
				AmountCents: 100 + int64(i%100000), Currency: "EUR", Note: orderNote,
				CreatedAt: base.Add(time.Duration(i) * time.Microsecond)}
			payload, err := encodePayload(&o)
			if err != nil {
				return err
			}
			id := uuid.Must(uuid.NewV7()).String()
			at := o.CreatedAt.Format(sqliteTime)
			if _, err := stmt.ExecContext(ctx, id, eventType, aggregateType, o.CustomerID, seqs[a], id, payload, at, at, at, at); err != nil {
				return err
			}
		}
		for a, seq := range seqs {
			if seq == 0 {
				continue
			}
			if _, err := tx.ExecContext(ctx, `INSERT INTO outbox_records_sequences (aggregate_type, aggregate_id, last_sequence) VALUES (?, ?, ?)`,
				aggregateType, customerID(a), seq); err != nil {
				return err
			}
		}
		return nil
	})
}

// quietLogger keeps the library's and the peers' informational logs out of
// the tables; warnings and errors still reach stderr.
var quietLogger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

// drainOutbox drains the backlog with dispatchers outbox dispatchers, each
// on a *gorm.DB of its own from open, each in Run; the clock stops when
// the last Run returns after its publisher saw the last of n events.
func drainOutbox(ctx context.Context, open func() (*gorm.DB, error), dispatchers, batch, n int) (drainResult, error) {
	ctx, cancel := context.WithTimeout(ctx, drainTimeout(n))
	defer cancel()
	running, stop := context.WithCancel(ctx)
	defer stop()
	var published, batches atomic.Int64
	counter := outbox.PublisherFunc(func(_ context.Context, b outbox.Batch) error {
		batches.Add(1)
		if published.Add(int64(len(b.Messages))) >= int64(n) {
			stop()
		}
		return nil
	})
	ds := make([]*outbox.Dispatcher, dispatchers)
	for i := range ds {
		db, err := open()
		if err != nil {
			return drainResult{}, err
		}
		defer closeGorm(db)
		if ds[i], err = outbox.NewDispatcher(db, counter, outbox.WithBatchSize(batch), outbox.WithLogger(quietLogger)); err != nil {
			return drainResult{}, err
		}
	}
	// Run, as a service runs its dispatchers, side by side on one table.
	// Each Run returns once the batch it has in flight is settled, so the
	// clock stops when the last event is delivered.
	start := time.Now()
	var wg sync.WaitGroup
	for _, d := range ds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = d.Run(running) // returns nil; it logs its errors
		}()
	}
	wg.Wait()
	res := drainResult{done: int(min(published.Load(), int64(n))), batches: int(batches.Load()), elapsed: time.Since(start)}
	if res.done < n {
		if err := ctx.Err(); err != nil && !errors.Is(err, context.DeadlineExceeded) {
			return drainResult{}, err
		}
		res.timedOut = true
	}
	return res, nil
}

// rawDialect is the two statements of the raw-SQL loop on one engine.
type rawDialect struct {
	claim  string                                       // args: now, limit, lease, batch id
	settle func(ids []int64) (query string, args []any) // settle args go after now, batch id
	time   func(time.Time) any
}

// rawPostgres claims in the due index's order with FOR UPDATE SKIP LOCKED
// and leases the rows in the same statement; it settles by id.
var rawPostgres = rawDialect{
	claim: `WITH c AS (
	SELECT id FROM outbox_records
	WHERE delivery_state IN ('pending', 'retry', 'delivering') AND next_attempt_at <= $1
	ORDER BY next_attempt_at, id
	LIMIT $2
	FOR UPDATE SKIP LOCKED
)
UPDATE outbox_records r SET delivery_state = 'delivering', batch_id = $4, locked_until = $3,
	next_attempt_at = $3, updated_at = $1
FROM c WHERE r.id = c.id
RETURNING r.id, r.event_id, r.event_type, r.aggregate_type, r.aggregate_id, r.aggregate_sequence,
	r.idempotency_key, r.payload, r.headers, r.occurred_at, r.delivery_attempts`,
	settle: func(ids []int64) (string, []any) {
		return `UPDATE outbox_records SET delivery_state = 'delivered', delivery_attempts = delivery_attempts + 1,
	locked_until = NULL, delivered_at = $1, next_attempt_at = $1, updated_at = $1
WHERE id = ANY($3) AND batch_id = $2 AND delivery_state = 'delivering'`, []any{ids}
	},
	time: func(t time.Time) any { return t.UTC() },
}

// rawSQLite does the same on SQLite, where the claim's write lock holds the
// whole database, so there is nothing to skip.
var rawSQLite = rawDialect{
	claim: `UPDATE outbox_records SET delivery_state = 'delivering', batch_id = ?4, locked_until = ?3,
	next_attempt_at = ?3, updated_at = ?1
WHERE id IN (
	SELECT id FROM outbox_records
	WHERE delivery_state IN ('pending', 'retry', 'delivering') AND next_attempt_at <= ?1
	ORDER BY next_attempt_at, id
	LIMIT ?2
)
RETURNING id, event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence,
	idempotency_key, payload, headers, occurred_at, delivery_attempts`,
	settle: func(ids []int64) (string, []any) {
		args := make([]any, len(ids))
		for i, id := range ids {
			args[i] = id
		}
		return `UPDATE outbox_records SET delivery_state = 'delivered', delivery_attempts = delivery_attempts + 1,
	locked_until = NULL, delivered_at = ?1, next_attempt_at = ?1, updated_at = ?1
WHERE batch_id = ?2 AND delivery_state = 'delivering' AND id IN (?` + strings.Repeat(", ?", len(ids)-1) + `)`, args
	},
	time: func(t time.Time) any { return t.UTC().Format(sqliteTime) },
}

// rawMessage is what the raw loop reads of a claimed row, as a publisher
// would need it.
type rawMessage struct {
	id                                      int64
	eventID, eventType, aggType, aggID, key string
	seq                                     int64
	payload                                 []byte
	headers                                 sql.NullString
	occurredAt                              any
	attempts                                int
}

// drainRaw drains the backlog with workers raw-SQL loops, each on a pool
// of its own from open.
func drainRaw(ctx context.Context, open func() (*sql.DB, error), d rawDialect, workers, batch, n int) (drainResult, error) {
	dbs := make([]*sql.DB, workers)
	for i := range dbs {
		db, err := open()
		if err != nil {
			return drainResult{}, err
		}
		defer db.Close()
		dbs[i] = db
	}
	return drainLoop(ctx, workers, n, func(ctx context.Context, w int) (int, error) {
		return rawOnce(ctx, dbs[w], d, batch)
	})
}

// rawOnce claims up to batch rows, "publishes" them to nothing and settles
// them; it returns how many it settled.
func rawOnce(ctx context.Context, db *sql.DB, d rawDialect, batch int) (int, error) {
	now := time.Now()
	batchID := uuid.Must(uuid.NewV7()).String()
	rows, err := db.QueryContext(ctx, d.claim, d.time(now), batch, d.time(now.Add(30*time.Second)), batchID)
	if err != nil {
		return 0, fmt.Errorf("claim: %w", err)
	}
	var msgs []rawMessage
	for rows.Next() {
		var m rawMessage
		if err := rows.Scan(&m.id, &m.eventID, &m.eventType, &m.aggType, &m.aggID, &m.seq, &m.key,
			&m.payload, &m.headers, &m.occurredAt, &m.attempts); err != nil {
			rows.Close()
			return 0, fmt.Errorf("claim: scan: %w", err)
		}
		msgs = append(msgs, m)
	}
	if err := rows.Close(); err != nil {
		return 0, err
	}
	if err := rows.Err(); err != nil {
		return 0, fmt.Errorf("claim: %w", err)
	}
	if len(msgs) == 0 {
		return 0, nil
	}
	ids := make([]int64, len(msgs))
	for i, m := range msgs {
		ids[i] = m.id
	}
	q, extra := d.settle(ids)
	res, err := db.ExecContext(ctx, q, append([]any{d.time(time.Now()), batchID}, extra...)...)
	if err != nil {
		return 0, fmt.Errorf("settle: %w", err)
	}
	settled, err := res.RowsAffected()
	if err != nil {
		return 0, err
	}
	return int(settled), nil
}

// sqliteSQL opens a database/sql pool of one connection on a SQLite file.
func sqliteSQL(dsn string) (*sql.DB, error) {
	db, err := sql.Open("sqlite3", dsn)
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(1)
	return db, nil
}
