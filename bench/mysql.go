package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"time"

	mysqldriver "github.com/go-sql-driver/mysql"
	"github.com/google/uuid"
	"gorm.io/driver/mysql"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
)

// The mysql scenario: the dispatch scenario on MySQL (MariaDB on this
// machine, at OUTBOX_MYSQL_DSN): the outbox dispatcher against a raw-SQL
// loop doing the statements the outbox does there, without the order
// check: a READ COMMITTED transaction that reads the oldest due rows
// through the due index with FOR UPDATE SKIP LOCKED, leases them by
// primary key and reads them back (MySQL has no UPDATE ... RETURNING),
// then a settle by primary key. Per batch, both send the same
// statements: SET TRANSACTION, START TRANSACTION, window, lease, read
// back, COMMIT, settle; the outbox adds the order check's lookup when a
// batch's first event of an aggregate follows one it did not see
// delivered. Every drain gets a fresh database with a freshly loaded
// backlog and ANALYZE TABLE before the clock starts, and the work its
// connections ask of the server is counted (mysqlwork.go).

const defaultMySQLDSN = "root@tcp(127.0.0.1:3306)/test?parseTime=true&loc=UTC"

func mysqlDSN() string {
	if dsn := os.Getenv("OUTBOX_MYSQL_DSN"); dsn != "" {
		return dsn
	}
	return defaultMySQLDSN
}

func runMySQL(ctx context.Context, _ *env, c config, r *report) error {
	base, err := mysqldriver.ParseDSN(mysqlDSN())
	if err != nil {
		return fmt.Errorf("OUTBOX_MYSQL_DSN: %w", err)
	}
	var rows, work, detail, stmts [][]string
	for _, batch := range c.batchSizes {
		for _, n := range c.dispatchers {
			cfg := fmt.Sprintf("%d dispatcher(s), batch %d", n, batch)
			suffix := fmt.Sprintf("%dd_b%d", n, batch)
			g := []drainSpec{
				{"outbox, MySQL", cfg, "dispatch_mysql_outbox_" + suffix, func() (drainResult, error) {
					return mysqlDrain(ctx, base, c, func(dsn string) (drainResult, error) {
						return drainOutbox(ctx, func() (*gorm.DB, error) { return openGorm(mysql.Open(dsn), 2) }, n, batch, c.backlog)
					})
				}},
				{"raw SQL loop, MySQL", cfg, "dispatch_mysql_raw_" + suffix, func() (drainResult, error) {
					return mysqlDrain(ctx, base, c, func(dsn string) (drainResult, error) {
						return drainRawMySQL(ctx, dsn, n, batch, c.backlog)
					})
				}},
			}
			results, err := drainRepeated(g, c.repeat)
			if err != nil {
				return err
			}
			for i, spec := range g {
				res := median(results[i])
				r.add(spec.name, res.rate(), "events/s")
				each := make([]string, len(results[i]))
				for k, x := range results[i] {
					each[k] = f1(x.rate())
				}
				note := ""
				if res.timedOut {
					note = "timed out, partial"
				}
				rows = append(rows, []string{spec.system, spec.config, fmt.Sprintf("%d", res.done),
					res.elapsed.Round(time.Millisecond).String(), f1(res.rate()), strings.Join(each, " "), note})
				work = append(work, workRow(spec.system, spec.config, results[i]))
				detail = append(detail, mysqlDetailRow(spec.system, spec.config, results[i]))
				stmts = append(stmts, statementRows(spec.system, spec.config, results[i])...)
			}
			name := "dispatch_mysql_ratio_outbox_over_raw_" + suffix
			r.ratio(name, "dispatch_mysql_outbox_"+suffix, "dispatch_mysql_raw_"+suffix)
		}
	}
	r.table(fmt.Sprintf("dispatch throughput on MySQL, backlog of %d events over %d aggregates, no-op publisher, median of %d drains", c.backlog, c.aggregates, c.repeat),
		[]string{"system", "configuration", "events", "time", "events/s", "each drain", ""}, rows)
	r.table(fmt.Sprintf("dispatch work asked of MySQL, median of %d drains (mysqlwork.go says how each is counted; the redo log is the whole server's)", c.repeat),
		mysqlWorkHeader(), work)
	r.table(fmt.Sprintf("dispatch work on MySQL in detail, from the sessions' status counters, median of %d drains", c.repeat),
		mysqlDetailHeader(), detail)
	r.table(fmt.Sprintf("statements on MySQL by kind (the start of their text), per batch over all %d drains", c.repeat),
		[]string{"system", "configuration", "per batch", "ms/batch", "statement"}, stmts)
	return nil
}

// mysqlWorkHeader is the work table's header, with MySQL's names for
// the server's commits and its log.
func mysqlWorkHeader() []string {
	h := slices.Clone(workHeader)
	for i, name := range h {
		switch name {
		case "tx/event (server)":
			h[i] = "engine commits/event (server)"
		case "buffers/event (least)":
			h[i] = "buffers/event (PostgreSQL only)"
		case "WAL bytes/event (least)":
			h[i] = "redo bytes/event (least)"
		}
	}
	return h
}

// mysqlDrain loads a backlog into the outbox table of a fresh database
// and drains it with fn, which gets a DSN of the database whose
// connections count their work (mysqlwork.go).
func mysqlDrain(ctx context.Context, base *mysqldriver.Config, c config, fn func(dsn string) (drainResult, error)) (drainResult, error) {
	admin, err := sql.Open("mysql", base.FormatDSN())
	if err != nil {
		return drainResult{}, err
	}
	defer admin.Close()
	name := fmt.Sprintf("outbox_bench_%d_%d", os.Getpid(), time.Now().UnixNano()%1e9)
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE `"+name+"` CHARACTER SET utf8mb4"); err != nil {
		return drainResult{}, fmt.Errorf("create database: %w", err)
	}
	defer admin.ExecContext(context.WithoutCancel(ctx), "DROP DATABASE `"+name+"`")
	conf := base.Clone()
	conf.DBName = name
	dsn := conf.FormatDSN()
	db, err := openGorm(mysql.Open(dsn), 2)
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
	if err := loadOutboxMySQL(ctx, sqlDB, c.backlog, c.aggregates); err != nil {
		return drainResult{}, fmt.Errorf("load backlog: %w", err)
	}
	if _, err := sqlDB.ExecContext(ctx, `ANALYZE TABLE outbox_records, outbox_records_sequences`); err != nil {
		return drainResult{}, fmt.Errorf("analyze: %w", err)
	}
	res, err := measureMySQLWork(ctx, admin, conf, fn)
	if err != nil {
		return drainResult{}, err
	}
	var left int
	if err := sqlDB.QueryRowContext(ctx, `SELECT count(*) FROM outbox_records WHERE delivery_state <> 'delivered'`).Scan(&left); err != nil {
		return drainResult{}, err
	}
	if left != 0 && !res.timedOut {
		return drainResult{}, fmt.Errorf("%d events left undelivered after the drain", left)
	}
	return res, nil
}

// loadOutboxMySQL inserts the same kind of backlog as loadOutboxPostgres,
// from Go, a thousand rows a statement.
func loadOutboxMySQL(ctx context.Context, db *sql.DB, n, aggregates int) error {
	rnd := rand.New(rand.NewPCG(1, 2))
	seqs := make([]int64, aggregates)
	base := time.Now().Add(-time.Hour).UTC()
	const chunk = 1000
	return inTx(ctx, db, func(tx *sql.Tx) error {
		for start := 0; start < n; start += chunk {
			var (
				q    strings.Builder
				args []any
			)
			q.WriteString(`INSERT INTO outbox_records (event_id, event_type, aggregate_type, aggregate_id,
	aggregate_sequence, idempotency_key, payload, delivery_state, delivery_attempts, next_attempt_at,
	occurred_at, created_at, updated_at) VALUES `)
			for i := start; i < min(start+chunk, n); i++ {
				a := rnd.IntN(aggregates)
				seqs[a]++
				o := benchOrder{ID: uint64(i + 1), CustomerID: customerID(a), Status: "placed",
					AmountCents: 100 + int64(i%100000), Currency: "EUR", Note: orderNote,
					CreatedAt: base.Add(time.Duration(i) * time.Microsecond)}
				payload, err := encodePayload(&o)
				if err != nil {
					return err
				}
				if i > start {
					q.WriteString(", ")
				}
				q.WriteString("(?, ?, ?, ?, ?, ?, ?, 'pending', 0, ?, ?, ?, ?)")
				id := uuid.Must(uuid.NewV7()).String()
				args = append(args, id, eventType, aggregateType, o.CustomerID, seqs[a], id, payload,
					o.CreatedAt, o.CreatedAt, o.CreatedAt, o.CreatedAt)
			}
			if _, err := tx.ExecContext(ctx, q.String(), args...); err != nil {
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

// The raw loop's statements on MySQL: those of the outbox's claim and
// settle (the library's internal/dialect/mysql.go) but for the order check.
const (
	rawMySQLWindow = `SELECT id FROM outbox_records WHERE due_at <= ? ORDER BY due_at, id LIMIT ? FOR UPDATE SKIP LOCKED`
	rawMySQLLease  = `UPDATE outbox_records x JOIN JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) j ON x.id = j.id
SET x.delivery_state = 'delivering', x.batch_id = ?, x.locked_until = ?, x.next_attempt_at = ?, x.updated_at = ?`
	rawMySQLRead = `SELECT x.id, x.event_id, x.event_type, x.aggregate_type, x.aggregate_id, x.aggregate_sequence,
	x.idempotency_key, x.payload, x.headers, x.occurred_at, x.delivery_attempts
FROM JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) j JOIN outbox_records x ON x.id = j.id AND x.batch_id = ?`
	rawMySQLSettle = `UPDATE outbox_records x JOIN JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) j ON x.id = j.id
SET x.delivery_state = 'delivered', x.delivery_attempts = x.delivery_attempts + 1, x.next_attempt_at = ?,
	x.last_error = NULL, x.failure_kind = NULL, x.locked_until = NULL, x.delivered_at = ?, x.updated_at = ?
WHERE x.batch_id = ? AND x.delivery_state = 'delivering'`
)

// drainRawMySQL drains the backlog with workers raw-SQL loops, each on a
// pool of its own.
func drainRawMySQL(ctx context.Context, dsn string, workers, batch, n int) (drainResult, error) {
	dbs := make([]*sql.DB, workers)
	for i := range dbs {
		db, err := sql.Open("mysql", dsn)
		if err != nil {
			return drainResult{}, err
		}
		db.SetMaxOpenConns(2)
		db.SetMaxIdleConns(2)
		defer db.Close()
		dbs[i] = db
	}
	return drainLoop(ctx, workers, n, func(ctx context.Context, w int) (int, error) {
		return rawOnceMySQL(ctx, dbs[w], batch)
	})
}

// rawOnceMySQL claims up to batch rows, reads them as a publisher would
// need them, and settles them; it returns how many it settled.
func rawOnceMySQL(ctx context.Context, db *sql.DB, batch int) (int, error) {
	now := time.Now().UTC().Truncate(time.Microsecond)
	lease := now.Add(30 * time.Second)
	batchID := uuid.Must(uuid.NewV7()).String()
	var ids []int64
	err := againAfterLockConflicts(func() error {
		ids = ids[:0]
		tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		if err != nil {
			return err
		}
		defer tx.Rollback()
		rows, err := tx.QueryContext(ctx, rawMySQLWindow, now, batch)
		if err != nil {
			return fmt.Errorf("window: %w", err)
		}
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				rows.Close()
				return err
			}
			ids = append(ids, id)
		}
		rows.Close()
		if err := rows.Err(); err != nil || len(ids) == 0 {
			return err
		}
		list, _ := json.Marshal(ids)
		if _, err := tx.ExecContext(ctx, rawMySQLLease, list, batchID, lease, lease, now); err != nil {
			return fmt.Errorf("lease: %w", err)
		}
		res, err := tx.QueryContext(ctx, rawMySQLRead, list, batchID)
		if err != nil {
			return fmt.Errorf("read: %w", err)
		}
		for res.Next() {
			var m rawMessage
			if err := res.Scan(&m.id, &m.eventID, &m.eventType, &m.aggType, &m.aggID, &m.seq, &m.key,
				&m.payload, &m.headers, &m.occurredAt, &m.attempts); err != nil {
				res.Close()
				return err
			}
		}
		res.Close()
		if err := res.Err(); err != nil {
			return err
		}
		return tx.Commit()
	})
	if err != nil || len(ids) == 0 {
		return 0, err
	}
	list, _ := json.Marshal(ids)
	done := time.Now().UTC().Truncate(time.Microsecond)
	var settled int64
	err = againAfterLockConflicts(func() error {
		res, err := db.ExecContext(ctx, rawMySQLSettle, list, done, done, done, batchID)
		if err != nil {
			return fmt.Errorf("settle: %w", err)
		}
		settled, err = res.RowsAffected()
		return err
	})
	return int(settled), err
}

// againAfterLockConflicts runs fn, a whole transaction or a statement of
// its own, again while the server ends it for a deadlock or a lock wait
// timeout, as the library's dispatcher does (which, after its own five
// tries, tries again at its next claim: the loop has no next claim for
// the same rows, so it tries longer).
func againAfterLockConflicts(fn func() error) error {
	for attempt := 0; ; attempt++ {
		err := fn()
		var me *mysqldriver.MySQLError
		if !errors.As(err, &me) || (me.Number != 1213 && me.Number != 1205) || attempt == 50 {
			return err
		}
		time.Sleep(time.Duration(attempt+1) * time.Millisecond)
	}
}
