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
)

// A claim leases up to a batch of claimable rows, in one short transaction
// (dialect.claimTx), so that no two claims take the same row and no claim
// breaks an aggregate's order.
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
// The claim has two parts, both checked in the dispatcher against that
// rule, whatever order the engine returns rows in:
//
//  1. Oldest first: the batch size of oldest claimable rows (the window,
//     locked as it is read), of which it keeps, per aggregate, the rows
//     from its lowest sequence on without a gap, provided the event before
//     that one is delivered (one lookup statement for all the aggregates).
//     A backlog is thus taken in the order it was written, which keeps a
//     batch on a few neighbouring pages.
//  2. Runs, only when the window held rows back (other dispatchers hold
//     their aggregates, or their predecessor waits for a retry) and the
//     batch has room: heads, the oldest claimable rows whose predecessor
//     is delivered, among the first scanWindow claimable rows; then each
//     head's run, its aggregate's consecutive claimable sequences, until
//     the batch is full; then a lock of those rows, and a run ends at the
//     first row the lock skips (another claim holds it).
//
// Several dispatchers on one backlog would hold each other back at every
// claim: each window would begin with the rows of aggregates that the
// other dispatchers' batches hold, and runs would have to top up every
// batch. A dispatcher whose full window was held back that way claims by
// shard instead (nextShard): part 1 alone, its window limited to the
// aggregates of one of 8 shards, by a hash of aggregate type and id, and
// so mostly to aggregates no other dispatcher holds. The order rule is the
// same; a shard only narrows the window.
//
// The lease then writes exactly the rows it takes. Rows behind an event
// that waits for a retry or was dead-lettered are moved out of the due
// range by parkBlocked, so that they do not fill every claim's window.

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

// windowRow is a row of a claim's window, or a head.
type windowRow struct {
	id  int64
	agg aggregateKey
	seq int64
}

// scanWindow is how many claimable rows a claim of n looks at for heads,
// and parkBlocked for rows to park: enough to pass by the runs several
// other dispatchers hold, and a bound on what a claim steps over.
func scanWindow(n int) int { return max(4*n, 1000) }

// claim leases up to the batch size of rows under a fresh batch id. Where
// the engine says the oldest-first part in one statement (PostgreSQL), it
// runs that, and tops the batch up by runs in a transaction of its own
// only when the window held rows back; elsewhere both parts run in one
// transaction. A claim by shard takes no runs.
func (d *Dispatcher) claim(ctx context.Context) (claimResult, error) {
	now := time.Now()
	r := claimResult{batchID: uuid.Must(uuid.NewV7()).String()}
	shard := -1 // every aggregate
	if d.shardable() {
		shard = int(d.shard.Load()) - 1
	}
	seen := 0
	var err error
	if d.st.claim != "" && !d.runsOnly {
		seen, r.rows, r.blocked, err = d.claimOldest(ctx, now, r.batchID, shard)
		if err == nil && shard < 0 && len(r.rows) < seen && len(r.rows) < d.batchSize {
			taken := make(map[int64]bool, len(r.rows))
			for _, row := range r.rows {
				taken[row.id] = true
			}
			var runs []claimed
			terr := d.d.claimTx(ctx, d.db, func(q querier) error {
				var err error
				runs, _, err = d.claimSteps(ctx, q, now, r.batchID, nil, true, true, taken)
				return err
			})
			switch {
			case terr != nil && len(r.rows) == 0:
				err = terr
			case terr != nil:
				// The window's rows are leased already: dispatch them
				// rather than leave them until their lease passes.
				d.log.Warn("outbox: could not top up a batch by runs; dispatching what the claim took",
					"batch_id", r.batchID, "messages", len(r.rows), "error", terr)
			default:
				r.rows = append(r.rows, runs...)
			}
		}
	} else {
		err = d.d.claimTx(ctx, d.db, func(q querier) error {
			var win []windowRow
			if !d.runsOnly {
				var err error
				if shard < 0 {
					win, err = queryRows(ctx, q, d.st.window, d.d.timeArg(now), d.batchSize)
				} else {
					win, err = queryRows(ctx, q, d.st.windowShard, d.d.timeArg(now), d.batchSize, shard)
				}
				if err != nil {
					return fmt.Errorf("window: %w", err)
				}
			}
			seen = len(win)
			var err error
			r.rows, r.blocked, err = d.claimSteps(ctx, q, now, r.batchID, win, d.runsOnly, shard < 0, nil)
			return err
		})
	}
	if err != nil {
		return claimResult{}, fmt.Errorf("outbox: claim: %w", err)
	}
	sort.Slice(r.rows, func(i, j int) bool { return r.rows[i].id < r.rows[j].id })
	r.more = len(r.rows) == d.batchSize || (len(r.rows) > 0 && (seen == d.batchSize || shard >= 0))
	d.nextShard(shard, seen, len(r.rows), r.blocked)
	return r, nil
}

// shards is how many shards a claim in shard mode divides the aggregates
// into, by a hash of aggregate type and id.
const shards = 8

// shardable reports whether d's claims may read by shard: the engine has
// the statements, and the claims read a window.
func (d *Dispatcher) shardable() bool {
	return !d.runsOnly && (d.st.claimShard != "" || d.st.windowShard != "")
}

// nextShard sets what the next claim reads, after a claim of shard (-1:
// every aggregate) that saw seen rows in its window and took took of
// them. Dispatchers that claim from every aggregate hold each other back:
// each window starts with the rows of aggregates that other dispatchers'
// batches hold. A claim whose full window was held back that way moves
// to a shard; in a shard it goes on to the next one while they fill its
// batches, jumps to a random one when another claim holds its shard, and
// returns to every aggregate once a shard has fewer due rows than a
// batch. One dispatcher is never held back by another, and so never
// claims by shard; a shard's rows are still taken oldest first, and since
// a dispatcher goes through the shards in turn, no shard waits for the
// others' backlogs to drain.
func (d *Dispatcher) nextShard(shard, seen, took int, blocked bool) {
	if !d.shardable() {
		return
	}
	switch full := seen == d.batchSize; {
	case shard < 0 && full && took < seen && !blocked:
		d.shard.Store(rand.Int32N(shards) + 1)
	case shard < 0:
	case !full:
		d.shard.Store(0)
	case took < seen:
		d.shard.Store(rand.Int32N(shards) + 1)
	default:
		d.shard.Store(int32(shard+1)%shards + 1)
	}
}

// claimSteps leases, in q's transaction, what the window win allows
// (pickOldest) and, when the window held rows back and topUp allows it
// (claims by shard take no runs), or with runsOnly (no window was read),
// runs up to the batch size, none of them in taken.
// It reports whether the window held rows back behind a predecessor that
// is not in flight.
func (d *Dispatcher) claimSteps(ctx context.Context, q querier, now time.Time, batchID string, win []windowRow, runsOnly, topUp bool, taken map[int64]bool) ([]claimed, bool, error) {
	ts := d.d.timeArg(now)
	ids, blocked, err := d.pickOldest(ctx, q, ts, win)
	if err != nil {
		return nil, false, err
	}
	if room := d.batchSize - len(ids) - len(taken); (runsOnly || topUp && len(ids) < len(win)) && room > 0 {
		if taken == nil {
			taken = make(map[int64]bool, len(ids))
		}
		for _, id := range ids {
			taken[id] = true
		}
		runs, err := d.pickRuns(ctx, q, ts, taken, room)
		if err != nil {
			return nil, false, err
		}
		ids = append(ids, runs...)
	}
	if len(ids) == 0 {
		return nil, blocked, nil
	}
	res, err := q.QueryContext(ctx, d.st.lease, batchID, d.d.timeArg(now.Add(d.lease)), ts, d.d.idList(ids))
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
	query, args := d.st.claim, []any{batchID, d.d.timeArg(now.Add(d.lease)), d.d.timeArg(now), d.batchSize}
	if shard >= 0 {
		query, args = d.st.claimShard, append(args, shard)
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
func queryRows(ctx context.Context, q querier, query string, args ...any) ([]windowRow, error) {
	res, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer res.Close()
	var out []windowRow
	for res.Next() {
		var w windowRow
		if err := res.Scan(&w.id, &w.agg.typ, &w.agg.id, &w.seq); err != nil {
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
func (d *Dispatcher) pickOldest(ctx context.Context, q querier, now any, win []windowRow) ([]int64, bool, error) {
	first := make(map[aggregateKey]int64, len(win))
	present := make(map[aggregateSeq]int, len(win)) // rows per event
	var aggs []aggregateKey
	for _, w := range win {
		present[aggregateSeq{w.agg, w.seq}]++
		if f, ok := first[w.agg]; !ok {
			aggs = append(aggs, w.agg)
			first[w.agg] = w.seq
		} else if w.seq < f {
			first[w.agg] = w.seq
		}
	}
	var ask []aggregateSeq
	for _, k := range aggs {
		if f := first[k]; f > 1 {
			ask = append(ask, aggregateSeq{k, f - 1})
		}
	}
	blocked := false
	if len(ask) > 0 {
		states, err := queryStates(ctx, q, len(ask), d.st.undelivered, append([]any{now}, d.d.eventList(ask)...)...)
		if err != nil {
			return nil, false, fmt.Errorf("order check: %w", err)
		}
		for i, st := range states {
			if st.Valid {
				delete(first, ask[i].agg)
				blocked = blocked || st.String != "flight"
			}
		}
	}
	// Each aggregate's rows end before the first sequence missing from
	// the window, or at the first that two rows share (only a table
	// written by hand has such rows; one of them is taken).
	last := make(map[aggregateKey]int64, len(first))
	for k, f := range first {
		l := f
		for present[aggregateSeq{k, l}] == 1 && present[aggregateSeq{k, l + 1}] > 0 {
			l++
		}
		last[k] = l
	}
	ids := make([]int64, 0, len(win))
	for _, w := range win {
		e := aggregateSeq{w.agg, w.seq}
		if f, ok := first[w.agg]; ok && w.seq >= f && w.seq <= last[w.agg] && present[e] > 0 {
			ids = append(ids, w.id)
			present[e] = 0
		}
	}
	return ids, blocked, nil
}

// pickRuns returns the ids of up to room rows taken as runs, heads in
// order, each followed by its run, none of them in taken (the rows the
// window gave the claim), all of them locked for the claim. Runs are read in rounds, each asking for a
// span of sequences per head that shares the room between the heads
// left, so that what a round reads is bounded by the statement itself;
// the heads whose span was claimable to its end go on in the next round.
func (d *Dispatcher) pickRuns(ctx context.Context, q querier, now any, taken map[int64]bool, room int) ([]int64, error) {
	found, err := queryRows(ctx, q, d.st.heads, now, scanWindow(room), room)
	if err != nil {
		return nil, fmt.Errorf("heads: %w", err)
	}
	heads := make([]aggregateSeq, 0, len(found))
	for _, h := range found {
		if !taken[h.id] {
			heads = append(heads, aggregateSeq{h.agg, h.seq})
		}
	}
	// picked[i] is the run of heads[i]; live maps each head still read to
	// its index.
	picked := make([][]int64, len(heads))
	live := make([]int, len(heads))
	for i := range live {
		live[i] = i
	}
	n := 0
	for round := 0; n < room && len(live) > 0 && round < maxRunRounds; round++ {
		span := (room - n + len(live) - 1) / len(live)
		from := make([]aggregateSeq, len(live))
		for j, i := range live {
			from[j] = aggregateSeq{heads[i].agg, heads[i].seq + int64(len(picked[i]))}
		}
		runs, err := d.readRuns(ctx, q, now, span, from)
		if err != nil {
			return nil, err
		}
		var next []int
		for j, i := range live {
			seq := from[j].seq
			for _, row := range runs[j] {
				if n == room || row.seq != seq || !row.claimable {
					break
				}
				picked[i] = append(picked[i], row.id)
				seq++
				n++
			}
			if seq == from[j].seq+int64(span) {
				next = append(next, i)
			}
		}
		live = next
	}
	if n > 0 && d.st.lock != "" {
		all := make([]int64, 0, n)
		for _, p := range picked {
			all = append(all, p...)
		}
		locked, err := queryIDs(ctx, q, d.st.lock, now, d.d.idList(all))
		if err != nil {
			return nil, fmt.Errorf("lock runs: %w", err)
		}
		for i, p := range picked {
			for j, id := range p {
				if !locked[id] {
					picked[i] = p[:j] // a run never jumps over a row
					break
				}
			}
		}
	}
	var ids []int64
	for _, p := range picked {
		ids = append(ids, p...)
	}
	return ids, nil
}

// maxRunRounds bounds the rounds of one claim's runs: a claim that has
// room left after them takes the rest of the runs next time.
const maxRunRounds = 4

// runRow is a row of a run, by sequence.
type runRow struct {
	id, seq   int64
	claimable bool
}

// readRuns returns, for each head, the undelivered rows of its aggregate
// from its sequence on, span sequences at most, in sequence order.
func (d *Dispatcher) readRuns(ctx context.Context, q querier, now any, span int, heads []aggregateSeq) ([][]runRow, error) {
	res, err := q.QueryContext(ctx, d.st.runs, append([]any{now, span}, d.d.eventList(heads)...)...)
	if err != nil {
		return nil, fmt.Errorf("runs: %w", err)
	}
	defer res.Close()
	runs := make([][]runRow, len(heads))
	for res.Next() {
		var (
			i   int
			row runRow
		)
		if err := res.Scan(&i, &row.id, &row.seq, &row.claimable); err != nil {
			return nil, fmt.Errorf("runs: %w", err)
		}
		if i >= 1 && i <= len(heads) {
			runs[i-1] = append(runs[i-1], row)
		}
	}
	if err := res.Err(); err != nil {
		return nil, fmt.Errorf("runs: %w", err)
	}
	for _, run := range runs {
		sort.Slice(run, func(a, b int) bool { return run[a].seq < run[b].seq })
	}
	return runs, nil
}

// queryIDs reads a one-column result of ids.
func queryIDs(ctx context.Context, q querier, query string, args ...any) (map[int64]bool, error) {
	res, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer res.Close()
	out := map[int64]bool{}
	for res.Next() {
		var id int64
		if err := res.Scan(&id); err != nil {
			return nil, err
		}
		out[id] = true
	}
	return out, res.Err()
}

// queryStates reads a one-column text result, NULL allowed, that must
// have exactly n rows.
func queryStates(ctx context.Context, q querier, n int, query string, args ...any) ([]sql.NullString, error) {
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
	var occurred scanTime
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
