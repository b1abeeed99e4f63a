package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
)

// The write scenario: transactions per second of one business insert,
//
//	(a)  plain:          BEGIN; INSERT order RETURNING id; COMMIT (database/sql)
//	(b)  raw:            the same, plus by hand what the plugin writes: the
//	                     sequence upsert and the outbox insert, in one
//	                     statement as the plugin sends them
//	     raw_notify:     (b) plus the pg_notify the plugin adds by default
//	                     (PostgreSQL only)
//	     gorm:           db.Create(&order) through GORM without the plugin,
//	                     to show how much of c's cost is GORM's own
//	(c)  plugin:         db.Create(&order) through GORM with the outbox
//	                     plugin, default options
//	     plugin_nonotify: (c) with WithNotify(false) (PostgreSQL only)
//	     plugin_gormtx:   (c) inside db.Transaction, where the plugin cannot
//	                      see the commit (PostgreSQL only)
//	     plugin_tx:       (c) inside outbox.Transaction (PostgreSQL only)
//
// at 1 and 8 concurrent clients. Every variant gets a fresh schema (or
// SQLite file) and the same warm-up; the variants then take turns, a
// second each, until each has run for the duration.

type writeVariant struct {
	key, label   string
	postgresOnly bool
}

var writeVariants = []writeVariant{
	{"plain", "(a) plain insert, SQL", false},
	{"raw", "(b) insert + outbox + sequence by hand, SQL", false},
	{"raw_notify", "    (b) + pg_notify, SQL", true},
	{"gorm", "    insert through GORM, no plugin", false},
	{"plugin", "(c) insert through GORM + plugin (defaults)", false},
	{"plugin_nonotify", "    (c) with WithNotify(false)", true},
	{"plugin_gormtx", "    (c) inside db.Transaction", true},
	{"plugin_tx", "    (c) inside outbox.Transaction", true},
}

// writeEngine opens a fresh database for one measurement.
type writeEngine struct {
	name   string // "postgres" or "sqlite"
	prefix string // figure name prefix
	open   func(ctx context.Context, maxConns int) (*gorm.DB, func(), error)
}

func runWrite(ctx context.Context, e *env, c config, r *report) error {
	engines := []writeEngine{{
		name: "postgres", prefix: "write_",
		open: func(ctx context.Context, maxConns int) (*gorm.DB, func(), error) {
			s, err := e.newSchema(ctx, "write")
			if err != nil {
				return nil, nil, err
			}
			db, err := s.gormDB(maxConns)
			if err != nil {
				s.drop()
				return nil, nil, err
			}
			return db, func() { closeGorm(db); s.drop() }, nil
		},
	}}
	if c.sqlite {
		engines = append(engines, writeEngine{
			name: "sqlite", prefix: "write_sqlite_",
			open: func(ctx context.Context, maxConns int) (*gorm.DB, func(), error) {
				dsn := e.sqliteFile("write")
				db, err := sqliteGorm(dsn, maxConns)
				if err != nil {
					return nil, nil, err
				}
				return db, func() { closeGorm(db); removeSQLite(dsn) }, nil
			},
		})
	}

	for _, eng := range engines {
		results := map[string]map[int]float64{}
		var variants []writeVariant
		for _, v := range writeVariants {
			if eng.name == "postgres" || !v.postgresOnly {
				variants = append(variants, v)
			}
		}
		for _, clients := range c.writeClients {
			tps, err := retry(ctx, e, fmt.Sprintf("write %s %dc", eng.name, clients), func() (map[string]float64, error) {
				return measureWrites(ctx, eng, variants, clients, c)
			})
			if err != nil {
				return fmt.Errorf("%s at %d clients: %w", eng.name, clients, err)
			}
			for _, v := range variants {
				if results[v.key] == nil {
					results[v.key] = map[int]float64{}
				}
				results[v.key][clients] = tps[v.key]
				r.add(fmt.Sprintf("%s%s_%dc", eng.prefix, v.key, clients), tps[v.key], "tx/s")
			}
		}

		header := []string{"variant"}
		for _, clients := range c.writeClients {
			header = append(header, fmt.Sprintf("%d client(s) tx/s", clients))
		}
		var rows [][]string
		for _, v := range variants {
			row := []string{v.label}
			for _, clients := range c.writeClients {
				row = append(row, f1(results[v.key][clients]))
			}
			rows = append(rows, row)
		}
		for _, q := range []struct {
			label, num, den, name string
			postgresOnly          bool
		}{
			{"c/a (plugin over plain insert)", "plugin", "plain", "c_over_a", false},
			{"c/b (plugin over the outbox SQL by hand)", "plugin", "raw", "c_over_b", false},
			{"c/(b+notify) (like for like with NOTIFY)", "plugin", "raw_notify", "c_over_b_notify", true},
			{"c without notify / b", "plugin_nonotify", "raw", "c_nonotify_over_b", true},
			{"c in db.Transaction / b", "plugin_gormtx", "raw", "c_gormtx_over_b", true},
			{"c in outbox.Transaction / b", "plugin_tx", "raw", "c_tx_over_b", true},
			{"gorm/a (GORM over plain insert)", "gorm", "plain", "gorm_over_a", false},
		} {
			if q.postgresOnly && eng.name != "postgres" {
				continue
			}
			row := []string{q.label}
			for _, clients := range c.writeClients {
				row = append(row, ratioCell(results[q.num][clients], results[q.den][clients]))
				r.ratio(fmt.Sprintf("%sratio_%s_%dc", eng.prefix, q.name, clients),
					fmt.Sprintf("%s%s_%dc", eng.prefix, q.num, clients),
					fmt.Sprintf("%s%s_%dc", eng.prefix, q.den, clients))
			}
			rows = append(rows, row)
		}
		r.table(fmt.Sprintf("write cost, %s (%v per variant, in turns of %v)", eng.name, c.writeTime, min(writeRound, c.writeTime)), header, rows)
	}
	return nil
}

// writeRound is how long each variant runs in turn: the variants take
// turns for the whole duration, so that a slow spell of the machine (other
// work, a checkpoint) falls on all of them alike instead of on one.
const writeRound = time.Second

// measureWrites measures every variant at one client count, each in a
// fresh database, and returns transactions per second by variant.
func measureWrites(ctx context.Context, eng writeEngine, variants []writeVariant, clients int, c config) (map[string]float64, error) {
	fns := make([]func(context.Context, *rand.Rand) error, len(variants))
	for i, v := range variants {
		db, cleanup, err := eng.open(ctx, clients)
		if err != nil {
			return nil, err
		}
		defer cleanup()
		if fns[i], err = setupWrite(ctx, db, eng.name, v.key, c.aggregates); err != nil {
			return nil, fmt.Errorf("%s: %w", v.key, err)
		}
	}

	rounds := max(1, int(c.writeTime/writeRound))
	slice := c.writeTime / time.Duration(rounds)
	warmup := min(time.Second, c.writeTime/5)
	done := make([]int, len(variants))
	spent := make([]time.Duration, len(variants))
	for round := range rounds {
		for i, fn := range fns {
			w := time.Duration(0)
			if round == 0 {
				w = warmup
			}
			n, elapsed, err := measureLoop(ctx, clients, w, slice, fn)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", variants[i].key, err)
			}
			done[i] += n
			spent[i] += elapsed
		}
	}
	tps := map[string]float64{}
	for i, v := range variants {
		tps[v.key] = rate(done[i], spent[i])
	}
	return tps, nil
}

// setupWrite prepares db for one variant (the plugin, the tables) and
// returns the transaction a client runs.
func setupWrite(ctx context.Context, db *gorm.DB, engine, variant string, customers int) (func(context.Context, *rand.Rand) error, error) {
	var err error
	switch variant {
	case "plugin", "plugin_gormtx", "plugin_tx":
		err = db.Use(outbox.Plugin())
	case "plugin_nonotify":
		err = db.Use(outbox.Plugin(outbox.WithNotify(false)))
	}
	if err != nil {
		return nil, fmt.Errorf("register plugin: %w", err)
	}
	if err := db.WithContext(ctx).AutoMigrate(&benchOrder{}); err != nil {
		return nil, fmt.Errorf("migrate orders: %w", err)
	}
	if err := outbox.AutoMigrate(db.WithContext(ctx)); err != nil {
		return nil, fmt.Errorf("migrate outbox: %w", err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		return nil, err
	}
	return writeTx(db, sqlDB, engine, variant, customers)
}

// writeTx returns the transaction one client runs, over and over.
func writeTx(db *gorm.DB, sqlDB *sql.DB, engine, variant string, customers int) (func(ctx context.Context, rnd *rand.Rand) error, error) {
	pg := engine == "postgres"
	insertOrder := `INSERT INTO bench_orders (customer_id, status, amount_cents, currency, note, created_at)
VALUES (?, ?, ?, ?, ?, ?) RETURNING id`
	if pg {
		insertOrder = `INSERT INTO bench_orders (customer_id, status, amount_cents, currency, note, created_at)
VALUES ($1, $2, $3, $4, $5, $6) RETURNING id`
	}
	insert := func(ctx context.Context, tx *sql.Tx, o *benchOrder) error {
		return tx.QueryRowContext(ctx, insertOrder, o.CustomerID, o.Status, o.AmountCents, o.Currency, o.Note, o.CreatedAt).Scan(&o.ID)
	}

	switch variant {
	case "plain":
		return func(ctx context.Context, rnd *rand.Rand) error {
			o := newOrder(rnd, customers)
			return inTx(ctx, sqlDB, func(tx *sql.Tx) error { return insert(ctx, tx, &o) })
		}, nil
	case "raw", "raw_notify":
		writeEvent := rawEventSQLite
		if pg {
			notify := variant == "raw_notify"
			writeEvent = func(ctx context.Context, tx *sql.Tx, o *benchOrder) error {
				return rawEventPostgres(ctx, tx, o, notify)
			}
		}
		return func(ctx context.Context, rnd *rand.Rand) error {
			o := newOrder(rnd, customers)
			return inTx(ctx, sqlDB, func(tx *sql.Tx) error {
				if err := insert(ctx, tx, &o); err != nil {
					return err
				}
				return writeEvent(ctx, tx, &o)
			})
		}, nil
	case "gorm", "plugin", "plugin_nonotify":
		return func(ctx context.Context, rnd *rand.Rand) error {
			o := newOrder(rnd, customers)
			return db.WithContext(ctx).Create(&o).Error
		}, nil
	case "plugin_gormtx":
		return func(ctx context.Context, rnd *rand.Rand) error {
			o := newOrder(rnd, customers)
			return db.WithContext(ctx).Transaction(func(tx *gorm.DB) error { return tx.Create(&o).Error })
		}, nil
	case "plugin_tx":
		return func(ctx context.Context, rnd *rand.Rand) error {
			o := newOrder(rnd, customers)
			return outbox.Transaction(db.WithContext(ctx), func(tx *gorm.DB) error { return tx.Create(&o).Error })
		}, nil
	}
	return nil, fmt.Errorf("unknown write variant %q", variant)
}

func inTx(ctx context.Context, db *sql.DB, fn func(*sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

// rawEventPostgres writes by hand what the plugin writes for one event on
// PostgreSQL: the sequence upsert and the outbox insert in one statement,
// and, with notify, the notification the plugin sends by default.
func rawEventPostgres(ctx context.Context, tx *sql.Tx, o *benchOrder, notify bool) error {
	payload, err := encodePayload(o)
	if err != nil {
		return err
	}
	id := uuid.Must(uuid.NewV7()).String()
	now := time.Now().UTC()
	tail := "''"
	if notify {
		tail = "pg_notify('outbox_records', '')::text"
	}
	var seq int64
	var void string
	return tx.QueryRowContext(ctx, `WITH seq AS (
	INSERT INTO outbox_records_sequences AS s (aggregate_type, aggregate_id, last_sequence)
	VALUES ($1, $2, 1)
	ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_sequence = s.last_sequence + 1
	RETURNING last_sequence
), ins AS (
	INSERT INTO outbox_records (event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence,
		idempotency_key, payload, delivery_state, delivery_attempts, next_attempt_at,
		occurred_at, created_at, updated_at)
	SELECT $3, $4, $1, $2, seq.last_sequence, $3, $5::jsonb, 'pending', 0, $6, $6, $6, $6 FROM seq
	ON CONFLICT (idempotency_key) DO NOTHING
	RETURNING aggregate_sequence
)
SELECT aggregate_sequence, `+tail+` FROM ins`,
		aggregateType, o.CustomerID, id, eventType, payload, now).Scan(&seq, &void)
}

// sqliteTime is the library's text form of timestamps in SQLite.
const sqliteTime = "2006-01-02 15:04:05.000000000+00:00"

// rawEventSQLite writes by hand what the plugin writes for one event on
// SQLite: the sequence upsert, then the outbox insert.
func rawEventSQLite(ctx context.Context, tx *sql.Tx, o *benchOrder) error {
	payload, err := encodePayload(o)
	if err != nil {
		return err
	}
	id := uuid.Must(uuid.NewV7()).String()
	now := time.Now().UTC().Format(sqliteTime)
	var seq int64
	if err := tx.QueryRowContext(ctx, `INSERT INTO outbox_records_sequences (aggregate_type, aggregate_id, last_sequence)
VALUES (?, ?, 1)
ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_sequence = last_sequence + 1
RETURNING last_sequence`, aggregateType, o.CustomerID).Scan(&seq); err != nil {
		return err
	}
	_, err = tx.ExecContext(ctx, `INSERT INTO outbox_records (event_id, event_type, aggregate_type,
	aggregate_id, aggregate_sequence, idempotency_key, payload, delivery_state,
	delivery_attempts, next_attempt_at, occurred_at, created_at, updated_at)
VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', 0, ?, ?, ?, ?)
ON CONFLICT (idempotency_key) DO NOTHING`,
		id, eventType, aggregateType, o.CustomerID, seq, id, payload, now, now, now, now)
	return err
}

// measureLoop runs fn in a loop on each of clients goroutines: first for
// warmup, uncounted, then for d. It returns how many calls completed in the
// measured window and how long the window really was. The first error
// stops every client and is returned.
func measureLoop(ctx context.Context, clients int, warmup, d time.Duration,
	fn func(ctx context.Context, rnd *rand.Rand) error) (int, time.Duration, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		done     atomic.Int64
		stop     atomic.Bool
		wg       sync.WaitGroup
		errOnce  sync.Once
		firstErr error
	)
	for i := range clients {
		wg.Add(1)
		go func(seed uint64) {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(seed, seed*7919+1))
			for !stop.Load() {
				if err := fn(ctx, rnd); err != nil {
					if !stop.Load() {
						errOnce.Do(func() { firstErr = err; cancel() })
					}
					return
				}
				done.Add(1)
			}
		}(uint64(i + 1))
	}

	wait := func(d time.Duration) bool {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(d):
			return true
		}
	}
	var n int64
	var elapsed time.Duration
	if wait(warmup) {
		start, before := time.Now(), done.Load()
		if wait(d) {
			n, elapsed = done.Load()-before, time.Since(start)
		}
	}
	stop.Store(true)
	wg.Wait()
	if firstErr != nil {
		return 0, 0, firstErr
	}
	if err := ctx.Err(); err != nil && elapsed == 0 {
		return 0, 0, err
	}
	if elapsed == 0 {
		return 0, 0, errors.New("measurement did not complete")
	}
	return int(n), elapsed, nil
}
