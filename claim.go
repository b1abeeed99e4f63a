package outbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"time"

	"github.com/google/uuid"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// A claim leases up to a batch of claimable rows, in one short transaction,
// so that no two claims take the same row and no claim breaks an
// aggregate's order.
//
// Order. An event is handed to a publisher only after the one before it in
// its aggregate was accepted, or after it in the same batch. A claim takes,
// per aggregate, consecutive sequences starting right after a delivered
// event (or at sequence 1, or after an event that cleanup deleted, which
// it does only to delivered rows). Delivered events form a prefix of their
// aggregate: a claim takes an event only behind a delivered one; a
// publisher may not accept an event after a failed one of its aggregate
// in the batch (settle marks such an event not attempted if it does); and
// settle marks all the accepted events of a batch delivered in one
// statement. The one exception is a settle that comes after its lease
// passed: the events it marks were accepted in order, their earlier ones,
// claimed again meanwhile, are delivered again, and first deliveries stay
// in order.
//
// Every claim has one shape, three steps in one transaction:
//
//  1. the window: the batch size of oldest claimable rows, in due order,
//     locked as they are read, skipping rows that another claim holds;
//  2. the order check: per aggregate, the window's rows from its lowest
//     sequence there on, without a gap, provided the event before that
//     lowest one is delivered or gone (one lookup for all the aggregates);
//  3. the lease of exactly those rows.
//
// On PostgreSQL the three are one statement (Statements.Claim), whose
// check is SQL: a row is kept when its offset from its aggregate's lowest
// sequence in the window equals its rank there. Elsewhere they are three
// statements in ClaimTx, and pickOldest checks the window in Go.
//
// Rows the check holds back stay where they are. Behind an event that
// waits for a retry or was dead-lettered, parkBlocked moves them out of
// the due range, so that they do not fill every window. Behind another
// dispatcher's batch in flight, they wait for its settle, within the
// publish timeout. Several dispatchers on one backlog would hold each
// other back at every claim: each window would begin with the rows of
// aggregates that the others' batches hold. A dispatcher whose full window
// was held back that way claims by shard instead (nextShard): its window
// limited to the aggregates of one of 8 shards, by a hash of aggregate
// type and id, and so mostly to aggregates no other dispatcher holds. The
// order rule is the same; a shard only narrows the window.

// claimed is one claimed row: its message and what settling it needs.
type claimed struct {
	id       int64
	attempts int // attempts made before this one
	msg      Message
	bad      error // the row cannot be read into a message (scanLeased)
}

// claimResult is what one claim took.
type claimResult struct {
	batchID string
	rows    []claimed // oldest first
	// more reports that due rows may remain: the batch is full, or the
	// claim took rows from a window that was full (the rows it held back
	// there are other dispatchers' to settle, and more may be due behind
	// them). The dispatcher then claims again at once rather than wait.
	more bool
	// blocked reports that the window held claimable rows back behind an
	// event that is not in flight, which parking (parkBlocked) may
	// release. Rows held back behind another dispatcher's batch are not:
	// it settles within the publish timeout.
	blocked bool
}

// windowRow is a row of a claim's window.
type windowRow struct {
	id  int64
	agg dialect.Aggregate
	seq int64
}

// claim leases up to the batch size of rows under a fresh batch id, in
// one statement where the engine has it (PostgreSQL), and otherwise as
// window, order check and lease in one ClaimTx.
func (d *Dispatcher) claim(ctx context.Context) (claimResult, error) {
	now := time.Now()
	r := claimResult{batchID: uuid.Must(uuid.NewV7()).String()}
	shard := -1 // every aggregate
	if d.shardable() {
		shard = int(d.shard.Load()) - 1
	}
	seen := 0
	var err error
	if d.st.Claim != "" {
		seen, r.rows, r.blocked, err = d.claimOldest(ctx, now, r.batchID, shard)
	} else {
		err = d.d.ClaimTx(ctx, d.db, func(q dialect.Querier) error {
			query, args := d.st.Window, []any{d.d.TimeArg(now), d.batchSize}
			if shard >= 0 {
				query, args = d.st.WindowShard, append(args, shard)
			}
			win, err := queryRows(ctx, q, query, args...)
			if err != nil {
				return fmt.Errorf("window: %w", err)
			}
			seen = len(win)
			r.rows, r.blocked, err = d.leaseOldest(ctx, q, now, r.batchID, win)
			return err
		})
	}
	if err != nil {
		d.shard.Store(0) // the next claim starts again from every aggregate
		return claimResult{}, fmt.Errorf("outbox: claim: %w", err)
	}
	sort.Slice(r.rows, func(i, j int) bool { return r.rows[i].id < r.rows[j].id })
	r.more = len(r.rows) == d.batchSize || (len(r.rows) > 0 && (seen == d.batchSize || shard >= 0))
	d.nextShard(shard, seen, len(r.rows), r.blocked)
	return r, nil
}

// shardable reports whether d's claims may read by shard: the engine has
// the statements (SQLite's claims never overlap, and never need them).
func (d *Dispatcher) shardable() bool {
	return d.st.ClaimShard != "" || d.st.WindowShard != ""
}

// shardClaims is how many full claims in a row a dispatcher takes from
// one shard before it moves on to the next.
const shardClaims = 8

// nextShard sets what the next claim reads, after a claim of shard (-1:
// every aggregate) that saw seen rows in its window and took took of
// them. Dispatchers that claim from every aggregate hold each other back:
// each window starts with the rows of aggregates that other dispatchers'
// batches hold. A claim whose full window was held back that way moves
// to a shard. In a shard, a dispatcher stays while its claims fill their
// batches, so that its next window begins behind its own settled batch
// rather than another's in flight, and moves on to the next shard after
// shardClaims of them; it jumps to a random shard when another claim
// holds its own, and returns to every aggregate once a shard has fewer
// due rows than a batch. One dispatcher is never held back by another,
// and so never claims by shard; a shard's rows are still taken oldest
// first, and since a dispatcher goes through the shards in turn, no shard
// waits for the others' backlogs to drain.
func (d *Dispatcher) nextShard(shard, seen, took int, blocked bool) {
	if !d.shardable() {
		return
	}
	switch full := seen == d.batchSize; {
	case shard < 0 && full && took < seen && !blocked:
		d.shard.Store(rand.Int32N(dialect.Shards) + 1)
	case shard < 0:
	case !full:
		d.shard.Store(0)
	case took < seen:
		d.shard.Store(rand.Int32N(dialect.Shards) + 1)
	default:
		if d.shardRun.Add(1) < shardClaims {
			return
		}
		d.shard.Store(int32(shard+1)%dialect.Shards + 1)
	}
	d.shardRun.Store(0)
}

// leaseOldest leases, in q's transaction, the rows of the window win that
// keep each aggregate's order (pickOldest), and reports whether it held
// rows back behind a predecessor that is not in flight.
func (d *Dispatcher) leaseOldest(ctx context.Context, q dialect.Querier, now time.Time, batchID string, win []windowRow) ([]claimed, bool, error) {
	ts := d.d.TimeArg(now)
	ids, blocked, err := d.pickOldest(ctx, q, ts, win)
	if err != nil || len(ids) == 0 {
		return nil, blocked, err
	}
	res, err := q.QueryContext(ctx, d.st.Lease, batchID, d.d.TimeArg(now.Add(d.lease)), ts, d.d.IDList(ids))
	if err != nil {
		return nil, false, fmt.Errorf("lease: %w", err)
	}
	defer res.Close()
	rows, err := scanLeased(res, len(ids))
	return rows, blocked, err
}

// claimOldest runs the engine's one-statement oldest-first claim and
// returns the window's size, the rows it leased, and whether it held rows
// back behind a predecessor that is not in flight.
func (d *Dispatcher) claimOldest(ctx context.Context, now time.Time, batchID string, shard int) (seen int, rows []claimed, blocked bool, err error) {
	query, args := d.st.Claim, []any{batchID, d.d.TimeArg(now.Add(d.lease)), d.d.TimeArg(now), d.batchSize}
	if shard >= 0 {
		query, args = d.st.ClaimShard, append(args, shard)
	}
	res, err := d.pool().QueryContext(ctx, query, args...)
	if err != nil {
		return 0, nil, false, err
	}
	defer res.Close()
	for res.Next() {
		var (
			id      sql.NullInt64
			r       claimed
			payload []byte
			headers sql.NullString
			at      any
			evID    sql.NullString
			typ     sql.NullString
			aggT    sql.NullString
			aggID   sql.NullString
			seq     sql.NullInt64
			key     sql.NullString
			tries   sql.NullInt64
		)
		if err := res.Scan(&seen, &blocked, &id, &evID, &typ, &aggT, &aggID, &seq, &key, &payload, &headers, &at, &tries); err != nil {
			return 0, nil, false, fmt.Errorf("scan: %w", err)
		}
		if !id.Valid {
			continue // the one row of a claim that leased nothing
		}
		r.id, r.attempts = id.Int64, int(tries.Int64)
		r.msg = Message{EventID: evID.String, EventType: typ.String, AggregateType: aggT.String, AggregateID: aggID.String,
			Sequence: seq.Int64, IdempotencyKey: key.String, Payload: payload, Attempt: r.attempts + 1}
		r.bad = readMessage(&r.msg, headers, at)
		rows = append(rows, r)
	}
	return seen, rows, blocked, res.Err()
}

// queryRows reads rows of id, aggregate_type, aggregate_id,
// aggregate_sequence.
func queryRows(ctx context.Context, q dialect.Querier, query string, args ...any) ([]windowRow, error) {
	res, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer res.Close()
	var out []windowRow
	for res.Next() {
		var w windowRow
		if err := res.Scan(&w.id, &w.agg.Type, &w.agg.ID, &w.seq); err != nil {
			return nil, err
		}
		out = append(out, w)
	}
	return out, res.Err()
}

// pickOldest returns the ids of the window's rows that keep each
// aggregate's order, in window order, and whether it held rows back behind
// an event that is not in flight (one that waits for a retry or a
// requeue, or whose lease has passed: parking's work):
// per aggregate, the rows from its lowest sequence in the window on,
// without a gap (a row missing from the window, because it is not
// claimable or another claim holds it, ends the aggregate's rows),
// provided the event before that lowest one is delivered or gone.
func (d *Dispatcher) pickOldest(ctx context.Context, q dialect.Querier, now any, win []windowRow) ([]int64, bool, error) {
	first := make(map[dialect.Aggregate]int64, len(win))
	present := make(map[dialect.Position]int, len(win)) // rows per event
	var aggs []dialect.Aggregate
	for _, w := range win {
		present[dialect.Position{Aggregate: w.agg, Seq: w.seq}]++
		if f, ok := first[w.agg]; !ok {
			aggs = append(aggs, w.agg)
			first[w.agg] = w.seq
		} else if w.seq < f {
			first[w.agg] = w.seq
		}
	}
	var ask []dialect.Position
	for _, k := range aggs {
		if f := first[k]; f > 1 {
			ask = append(ask, dialect.Position{Aggregate: k, Seq: f - 1})
		}
	}
	blocked := false
	if len(ask) > 0 {
		states, err := queryStates(ctx, q, len(ask), d.st.Undelivered, append([]any{now}, d.d.EventList(ask)...)...)
		if err != nil {
			return nil, false, fmt.Errorf("order check: %w", err)
		}
		for i, st := range states {
			if st.Valid {
				delete(first, ask[i].Aggregate)
				blocked = blocked || st.String != "flight"
			}
		}
	}
	// Each aggregate's rows end before the first sequence missing from
	// the window, or at the first that two rows share (only a table
	// written by hand has such rows; one of them is taken).
	last := make(map[dialect.Aggregate]int64, len(first))
	for k, f := range first {
		l := f
		for present[dialect.Position{Aggregate: k, Seq: l}] == 1 && present[dialect.Position{Aggregate: k, Seq: l + 1}] > 0 {
			l++
		}
		last[k] = l
	}
	ids := make([]int64, 0, len(win))
	for _, w := range win {
		e := dialect.Position{Aggregate: w.agg, Seq: w.seq}
		if f, ok := first[w.agg]; ok && w.seq >= f && w.seq <= last[w.agg] && present[e] > 0 {
			ids = append(ids, w.id)
			present[e] = 0
		}
	}
	return ids, blocked, nil
}

// queryStates reads a one-column text result, NULL allowed, that must
// have exactly n rows.
func queryStates(ctx context.Context, q dialect.Querier, n int, query string, args ...any) ([]sql.NullString, error) {
	res, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer res.Close()
	out := make([]sql.NullString, 0, n)
	for res.Next() {
		var st sql.NullString
		if err := res.Scan(&st); err != nil {
			return nil, err
		}
		out = append(out, st)
	}
	if err := res.Err(); err != nil {
		return nil, err
	}
	if len(out) != n {
		return nil, fmt.Errorf("%d answers to %d lookups", len(out), n)
	}
	return out, nil
}

// scanLeased reads the rows a lease returns; want is how many it expects.
// A row whose message cannot be built (headers that are not a JSON object
// of strings, a timestamp the driver cannot read: rows written by hand or
// by another program) is returned with bad set, to be dead-lettered, not
// published: failing the claim would leave it at the head of the due rows,
// failing every claim after it.
func scanLeased(res *sql.Rows, want int) ([]claimed, error) {
	rows := make([]claimed, 0, want)
	for res.Next() {
		var (
			r       claimed
			payload []byte
			headers sql.NullString
			at      any
		)
		if err := res.Scan(&r.id, &r.msg.EventID, &r.msg.EventType, &r.msg.AggregateType, &r.msg.AggregateID,
			&r.msg.Sequence, &r.msg.IdempotencyKey, &payload, &headers, &at, &r.attempts); err != nil {
			return nil, fmt.Errorf("scan: %w", err)
		}
		r.msg.Payload = payload
		r.msg.Attempt = r.attempts + 1
		r.bad = readMessage(&r.msg, headers, at)
		rows = append(rows, r)
	}
	return rows, res.Err()
}

// readMessage fills in m's occurrence time and headers from their stored
// forms, and returns the permanent error a row that cannot be read is
// dead-lettered with, or nil.
func readMessage(m *Message, headers sql.NullString, at any) error {
	var bad error
	var occurred dialect.Time
	if err := occurred.Scan(at); err != nil {
		bad = fmt.Errorf("occurred_at: %w", err)
	}
	m.OccurredAt = occurred.Time
	if headers.Valid {
		if err := json.Unmarshal([]byte(headers.String), &m.Headers); err != nil {
			bad = fmt.Errorf("headers: %w", err)
		}
	}
	if bad != nil {
		return Permanent(fmt.Errorf("%w: event %s: %w", errUnreadable, m.EventID, bad))
	}
	return nil
}

// errUnreadable is wrapped by the error that a row which cannot be read
// into a Message is dead-lettered with.
var errUnreadable = errors.New("outbox: event cannot be read")
