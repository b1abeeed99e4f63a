package main

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// The work a drain asks of the server, which, unlike its speed, does not
// move with the load of a shared machine:
//
//   - statements and round trips, counted on the client by a pgx tracer on
//     every connection that the schema's openers hand out: each statement
//     sent alone is one round trip, a pgx batch (pipeline) is one round trip
//     for all its statements; BEGIN and COMMIT count as statements. Not
//     counted: the one-off prepare of each statement on each connection,
//     pings, and connections that a library opens itself from the DSN
//     (the slot-lock connection of the code before the rewrite);
//   - transactions, counted on the client (a statement or batch after
//     which the connection is outside a transaction ends one) and on the
//     server (pg_stat_database xact_commit + xact_rollback of the
//     database, which counts every session in it: run the benchmark in a
//     database of its own for a clean figure);
//   - rows written: n_tup_ins + n_tup_upd + n_tup_del of the tables in the
//     drain's schema (pg_stat_user_tables), which no other session writes;
//   - buffers: the shared buffers that statements touched in the drain's
//     tables and their indexes, found in memory or read
//     (pg_statio_user_tables), which measures how much a statement reads,
//     where the other counts only see that it ran. Autovacuum's reads of
//     the tables count too, so the table shows the least over the drains;
//   - WAL bytes: how far pg_current_wal_insert_lsn() moved during the drain
//     (what pg_stat_wal.wal_bytes sums, read without its flush delay). WAL
//     is the whole server's, so other sessions on the machine add to it:
//     each drain is measured on its own, and the table shows the least.
//
// The server's statistics are flushed by each backend when it exits, so a
// sample waits until the schema's connections are closed.

// clientWork counts what a schema's connections send.
type clientWork struct {
	statements, roundTrips, transactions atomic.Int64
}

// tracer returns a pgx tracer that counts into w.
func (w *clientWork) tracer() pgx.QueryTracer { return workTracer{w} }

type workTracer struct{ w *clientWork }

var (
	_ pgx.QueryTracer = workTracer{}
	_ pgx.BatchTracer = workTracer{}
)

func (t workTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	t.w.statements.Add(1)
	t.w.roundTrips.Add(1)
	return ctx
}

func (t workTracer) TraceQueryEnd(_ context.Context, conn *pgx.Conn, _ pgx.TraceQueryEndData) {
	t.endOf(conn)
}

func (t workTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	t.w.roundTrips.Add(1)
	return ctx
}

func (t workTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {
	t.w.statements.Add(1)
}

func (t workTracer) TraceBatchEnd(_ context.Context, conn *pgx.Conn, _ pgx.TraceBatchEndData) {
	t.endOf(conn)
}

// endOf counts a transaction if the connection is outside one after a
// statement or batch: that statement committed, rolled back, or ran in a
// transaction of its own.
func (t workTracer) endOf(conn *pgx.Conn) {
	if conn.PgConn().TxStatus() == 'I' {
		t.w.transactions.Add(1)
	}
}

// workSample is the counters at one moment.
type workSample struct {
	statements, roundTrips, clientTx  int64
	serverTx, rows, buffers, walBytes int64
}

// serverWork is what a drain asked of the server: the difference of two
// samples, and how many events and batches it moved.
type serverWork struct {
	workSample
	events, batches int
	// detail is what an engine counts beyond the columns of the work
	// table, by name (mysqlwork.go); nil on PostgreSQL.
	detail map[string]int64
}

func (s workSample) sub(o workSample) workSample {
	return workSample{
		statements: s.statements - o.statements, roundTrips: s.roundTrips - o.roundTrips, clientTx: s.clientTx - o.clientTx,
		serverTx: s.serverTx - o.serverTx, rows: s.rows - o.rows, buffers: s.buffers - o.buffers, walBytes: s.walBytes - o.walBytes,
	}
}

// sampleWork waits until no connection of the schema other than the
// admin's is open (so that their statistics have reached the server), then
// reads the counters.
func (s *schema) sampleWork(ctx context.Context) (workSample, error) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		var open int
		if err := s.e.admin.QueryRowContext(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, s.name).Scan(&open); err != nil {
			return workSample{}, fmt.Errorf("sample work: %w", err)
		}
		if open == 0 || time.Now().After(deadline) {
			break
		}
		select {
		case <-ctx.Done():
			return workSample{}, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	w := workSample{statements: s.work.statements.Load(), roundTrips: s.work.roundTrips.Load(), clientTx: s.work.transactions.Load()}
	err := s.e.admin.QueryRowContext(ctx, `SELECT
	(SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()),
	(SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables WHERE schemaname = $1),
	(SELECT coalesce(sum(heap_blks_read + heap_blks_hit + coalesce(idx_blks_read + idx_blks_hit, 0)), 0)
		FROM pg_statio_user_tables WHERE schemaname = $1),
	pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint`, s.name).Scan(&w.serverTx, &w.rows, &w.buffers, &w.walBytes)
	if err != nil {
		return workSample{}, fmt.Errorf("sample work: %w", err)
	}
	return w, nil
}

// measureWork runs drain between two samples of the schema's work. The
// connections of db (the loader's) are closed first, so that only the
// drain's are counted; db opens new ones when it is used again.
func measureWork(ctx context.Context, s *schema, db *sql.DB, drain func() (drainResult, error)) (drainResult, error) {
	db.SetMaxIdleConns(0)
	defer db.SetMaxIdleConns(2)
	before, err := s.sampleWork(ctx)
	if err != nil {
		return drainResult{}, err
	}
	res, err := drain()
	if err != nil {
		return res, err
	}
	after, err := s.sampleWork(ctx)
	if err != nil {
		return drainResult{}, err
	}
	res.work = &serverWork{workSample: after.sub(before), events: res.done, batches: res.batches}
	return res, nil
}

// workRow formats the work of a figure's drains as a row of the work
// table: each column is the median over the drains, each drain's figure
// taken on its own, except WAL bytes, the least over the drains: other
// sessions only ever add WAL, so the least is the least disturbed.
func workRow(system, config string, rs []drainResult) []string {
	ws := measured(rs)
	if len(ws) == 0 {
		return []string{system, config, "-", "-", "-", "-", "-", "-", "-", "-", "-"}
	}
	return []string{system, config,
		workStat(ws, func(w *serverWork) (float64, bool) { return float64(w.events), true }, func(v float64) string { return fmt.Sprintf("%.0f", v) }, false),
		workStat(ws, perBatch(func(w *serverWork) int64 { return int64(w.events) }), f1, false),
		workStat(ws, perBatch(func(w *serverWork) int64 { return w.statements }), f2, false),
		workStat(ws, perBatch(func(w *serverWork) int64 { return w.roundTrips }), f2, false),
		workStat(ws, perEvent(func(w *serverWork) int64 { return w.clientTx }), f4, false),
		workStat(ws, perEvent(func(w *serverWork) int64 { return w.serverTx }), f4, false),
		workStat(ws, perEvent(func(w *serverWork) int64 { return w.rows }), f2, false),
		workStat(ws, func(w *serverWork) (float64, bool) { return float64(w.buffers) / float64(w.events), w.detail == nil }, f1, true),
		workStat(ws, perEvent(func(w *serverWork) int64 { return w.walBytes }), f1, true)}
}

// measured returns the work of the drains that measured it and moved
// events.
func measured(rs []drainResult) []*serverWork {
	var ws []*serverWork
	for _, r := range rs {
		if r.work != nil && r.work.events > 0 {
			ws = append(ws, r.work)
		}
	}
	return ws
}

// workStat is one column of a work table: per over the drains' work, the
// median or, with least, the least of the drains that have it, formatted;
// "-" if none has it.
func workStat(ws []*serverWork, per func(*serverWork) (float64, bool), format func(float64) string, least bool) string {
	var vs []float64
	for _, w := range ws {
		if v, ok := per(w); ok {
			vs = append(vs, v)
		}
	}
	if len(vs) == 0 {
		return "-"
	}
	slices.Sort(vs)
	if least {
		return format(vs[0])
	}
	return format(vs[(len(vs)-1)/2])
}

// perBatch and perEvent divide a count of a drain's work by its batches
// or its events.
func perBatch(n func(*serverWork) int64) func(*serverWork) (float64, bool) {
	return func(w *serverWork) (float64, bool) { return float64(n(w)) / float64(w.batches), w.batches > 0 }
}

func perEvent(n func(*serverWork) int64) func(*serverWork) (float64, bool) {
	return func(w *serverWork) (float64, bool) { return float64(n(w)) / float64(w.events), true }
}

var workHeader = []string{"system", "configuration", "events", "events/batch", "stmts/batch", "round trips/batch", "tx/event (client)", "tx/event (server)", "rows written/event", "buffers/event (least)", "WAL bytes/event (least)"}

func f4(v float64) string { return fmt.Sprintf("%.4f", v) }
