package outbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math/bits"
	"sort"
	"time"

	"github.com/google/uuid"
)

// A claim takes the oldest due events first, and runs when others hold them.
//
// Order. An event is handed to a publisher only after the one before it in
// its aggregate was accepted, or after it in the same batch. A claim checks
// exactly that: the event just before the first one it takes of an
// aggregate (sequence minus one) must be delivered, or gone (cleanup
// deletes only delivered rows), or not exist (sequence 1), or be the last
// event of the aggregate that this dispatcher saw accepted and marked
// delivered (acceptedSeqs), which is then not looked up. One index probe
// for one key, whatever the aggregate's history: a probe for "nothing
// undelivered before" would walk every index entry that the aggregate's
// delivered events left behind until VACUUM removes them, and grew with
// the backlog. It is enough because delivered events form a prefix of
// their aggregate's sequence: a claim takes an event only behind a
// delivered one, a publisher may not accept an event after a failed one
// of its aggregate in the batch, settle marks such an event not attempted
// if it does (see outcomes), and settle marks all the accepted events of
// a batch delivered in one statement. The one way a delivered event can
// sit behind an undelivered one is a settle that comes after its lease
// passed: the events it marks delivered were accepted in order, and the
// earlier ones, claimed again meanwhile, are delivered again; first
// deliveries stay in order. The events after such a delivered one are not
// held back by the earlier ones' second delivery, even if it is
// dead-lettered: they were accepted once, before it. Likewise after a
// crash of the server forgets a settle: an event that the dispatcher saw
// accepted does not hold back the next one while it goes out again.
//
// Runs. A run is the due prefix of one aggregate's undelivered events: it
// starts at a head (an event whose predecessor was delivered: the
// aggregate's first undelivered event but for a late settle) and goes on
// in sequence order, without gaps, up to the first event that is not due
// (waiting for a retry, in flight, dead-lettered). A run claim picks heads
// oldest first, through the due index in its order (next_attempt_at, id),
// and takes each head's run until the batch is full. While one dispatcher
// holds an aggregate's run, no other sees a head there before its end, so
// dispatchers sharing a backlog split it by aggregate instead of colliding
// on the same window of rows.
//
// Oldest first. The claim reads the batch size of oldest due rows (the
// window) and leases those that keep each aggregate's order: per
// aggregate, the rows from its first one in the window on, in sequence
// order without a gap, provided the event before that first one was
// delivered (one lookup per aggregate, not per row, all in one
// statement). A dispatcher thus takes its backlog in the order it was
// written, which keeps a batch on a few neighbouring pages; a run in an
// interleaved backlog is spread over as many pages as it has rows. A
// dispatcher that holds some of the slots (slots.go) reads the window of
// its own slots first, and when that is not full, the window of all.
// When the window holds rows back (other dispatchers hold their
// aggregates, or their heads wait for a retry or come after the window),
// the claim tops the batch up with runs, and if runs found any, a
// dispatcher that holds no slots claims by runs alone for the next ten
// poll intervals (runsPolls), then looks at the oldest rows again.
//
// The oldest-first claim is three statements in one short transaction:
// the window's read, which locks its rows; the lookup; the lease of the
// picked rows by primary key. The grouping in between runs in the
// dispatcher, where it costs microseconds: done in SQL, with window
// functions, it cost a 1,000-row claim about 2 ms of sorting and grouping
// on the server, more than the two extra round trips. The lookup is
// skipped for an aggregate whose event before the window's first one is
// the last one this dispatcher delivered (acceptedSeqs), which with one
// dispatcher draining a backlog is nearly every aggregate: it cost a
// 1,000-row claim another 2 to 3 ms, two heap fetches per aggregate for
// the index entries that the earlier versions of that event left behind.
// On PostgreSQL with the pgx driver, BEGIN travels with the window and
// COMMIT with the lease (dialect_postgres_claim.go), so the transaction
// costs two round trips when the lookup is skipped.
//
// Either way a claim writes exactly the rows it leases: no row is
// rewritten to be held back. Rows that are due but not heads are stepped
// over, and a run claim's head scan looks only at a bounded window of due
// rows (scanWindow). Those behind a run in flight stay: it settles within
// the publish timeout. Those behind an event that waits for a retry or was
// dead-lettered are moved out of the due range by parkBlocked until that
// event can move, so that a long outage does not fill every claim's window
// with everything that arrived during it; those that came due before
// their head in due order are moved behind it.

// claimArgs are the values one claim works with.
type claimArgs struct {
	now      time.Time
	leaseEnd time.Time
	batchID  string
	limit    int
	plan     string // leads the text of a runs claim (plan.go)
}

// dueSQL is the due predicate on the records table alias a: pending or
// retry rows whose time has come, and delivering rows whose lease has
// passed (a claim sets next_attempt_at to the lease's end). It takes one
// argument, now. The due index serves it in its order.
func dueSQL(a string) string {
	return a + `.delivery_state IN ('pending', 'retry', 'delivering') AND ` + a + `.next_attempt_at <= ?`
}

// headsSQL selects heads oldest first: due rows whose predecessor in their
// aggregate is delivered (see Order above; the first event of an aggregate
// has none to look for), among the first window due rows. The window bounds what a
// claim steps over: rows behind a run in flight stay due, and without it a
// claim would look at every one of them (a deep aggregate whose run is in
// flight made every other dispatcher's claim read all its rows). Heads
// beyond the window wait for the rows in it to move. Arguments: now,
// window, now. The table alias of the result is r; the caller appends
// LIMIT and any row-locking clause.
func headsSQL(t tables, columns string) string {
	return `SELECT ` + columns + `
	FROM (
		SELECT c.id AS wid, c.next_attempt_at AS wnext FROM ` + t.records + ` c
		WHERE ` + dueSQL("c") + `
		ORDER BY c.next_attempt_at, c.id
		LIMIT ?
	) w JOIN ` + t.records + ` r ON r.id = w.wid
	WHERE ` + dueSQL("r") + `
		AND (r.aggregate_sequence = 1 OR NOT EXISTS (
			SELECT 1 FROM ` + t.records + ` p
			WHERE p.aggregate_type = r.aggregate_type AND p.aggregate_id = r.aggregate_id
				AND p.aggregate_sequence = r.aggregate_sequence - 1 AND p.delivery_state <> 'delivered'))
	ORDER BY w.wnext, w.wid`
}

// scanWindow is how many due rows a claim of n looks at for heads, and
// parkBlocked for rows to park: enough to pass by the runs several other
// dispatchers hold.
func scanWindow(n int) int { return max(4*n, 1000) }

// leaseSQL is the UPDATE that leases the picked rows, given the condition
// that names them, and returns what a Message needs, and when the server
// started (dialect.serverStart). It commits without waiting for its WAL
// where d can (dialect.asyncCommit). Its arguments are batch id, lease
// end, lease end, now, then those of where.
func leaseSQL(d dialect, t tables, where string) string {
	return `UPDATE ` + t.records + ` SET
	delivery_state = 'delivering', batch_id = ?, locked_until = ?, next_attempt_at = ?, updated_at = ?
WHERE (` + where + `)` + d.asyncCommit() + `
RETURNING id, event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence,
	idempotency_key, payload, headers, ` + d.readTime("occurred_at") + `, delivery_attempts, ` + d.serverStart()
}

// windowSQL reads the window of an oldest-first claim: the batch size of
// oldest due rows, in due order, through the due index, locked with d's
// row-locking clause (dialect.skipLocked: none where the claim holds the
// database's write lock), so that claims running side by side read
// disjoint windows. Each row also carries when the server started
// (dialect.serverStart). Arguments: now, batch size.
func windowSQL(d dialect, t tables) string {
	return `SELECT r.id, r.aggregate_type, r.aggregate_id, r.aggregate_sequence, ` + d.serverStart() + ` FROM ` + t.records + ` r
WHERE ` + dueSQL("r") + `
ORDER BY r.next_attempt_at, r.id
LIMIT ?` + d.skipLocked()
}

// slotScan is how many of the oldest due rows a claim of n, or parking, of
// the slots in mask looks at for their rows: twice as many as it would
// need to find n if the slots held their share of the due rows, so that a
// claim of slots with few due rows among many of other slots stops early
// instead of reading every due row (it then reads the window of all).
func slotScan(n int, mask uint64) int {
	return max(n, 1000) * 2 * slotCount / max(bits.OnesCount64(mask), 1)
}

// aggregateKey names an aggregate.
type aggregateKey struct{ typ, id string }

// windowRow is a row of an oldest-first claim's window.
type windowRow struct {
	id          int64
	agg         aggregateKey
	seq         int64
	serverStart string
}

// aggregateSeq is one event of an aggregate, by its sequence.
type aggregateSeq struct {
	agg aggregateKey
	seq int64
}

// claimOldest leases what pickOldest takes from the window, in one short
// transaction (dialect.claimTx) that holds the window's rows from the read
// to the lease, and returns the leased rows and how many rows the window
// held. A window of slots (a bit mask, not 0) holds only their rows.
func (d *Dispatcher) claimOldest(ctx context.Context, a claimArgs, slots uint64) (rows []claimed, seen int, err error) {
	now := d.d.timeArg(a.now)
	query, args := windowSQL(d.d, d.t), []any{now, a.limit}
	if slots != 0 {
		query = d.d.slotLocks().window(d.t, d.d.serverStart())
		args = []any{now, slotScan(a.limit, slots), int64(slots), now, a.limit}
	}
	err = d.d.claimTx(ctx, d.db, func(q claimQuerier) error {
		win, err := readWindow(ctx, q, d.planTag()+d.d.bind(query), args...)
		if err != nil {
			return fmt.Errorf("window: %w", err)
		}
		seen = len(win)
		if len(win) > 0 {
			d.accepted.serverStarted(win[0].serverStart)
		}
		for _, w := range win {
			d.sawID(w.id)
		}
		ids, err := d.pickOldest(ctx, q, win)
		if err != nil || len(ids) == 0 {
			return err
		}
		in, idArgs := d.d.idsIn(ids)
		res, err := q.lease(ctx, d.planTag()+d.d.bind(leaseSQL(d.d, d.t, "id "+in)), append(leaseArgs(d.d, a), idArgs...)...)
		if err != nil {
			return err
		}
		rows, err = scanLeased(res, len(ids))
		if cerr := res.Close(); err == nil {
			err = cerr
		}
		return err
	})
	if err != nil {
		return nil, 0, err
	}
	return rows, seen, nil
}

// readWindow runs the window query.
func readWindow(ctx context.Context, q querier, query string, args ...any) (win []windowRow, err error) {
	res, err := q.query(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer func() {
		if cerr := res.Close(); err == nil {
			err = cerr
		}
	}()
	for res.Next() {
		var (
			w       windowRow
			started sql.NullString
		)
		if err := res.Scan(&w.id, &w.agg.typ, &w.agg.id, &w.seq, &started); err != nil {
			return nil, err
		}
		w.serverStart = started.String
		win = append(win, w)
	}
	return win, res.Err()
}

// pickOldest returns the ids of the window's rows that keep each
// aggregate's order: per aggregate, the rows from its lowest sequence in
// the window on, without a gap (a row missing from the window, because it
// is not due or another claim holds it, ends the aggregate's rows),
// provided the event before that lowest one was delivered. That event is
// looked up (dialect.undelivered: one statement for all the aggregates,
// one per 500 on SQLite) unless this dispatcher knows it was accepted
// (accepted).
func (d *Dispatcher) pickOldest(ctx context.Context, q querier, win []windowRow) ([]int64, error) {
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
		if f := first[k]; f > 1 && !d.accepted.has(k, f-1) {
			ask = append(ask, aggregateSeq{k, f - 1})
		}
	}
	if len(ask) > 0 {
		undelivered, err := d.d.undelivered(ctx, q, d.t, ask)
		if err != nil {
			return nil, fmt.Errorf("order check: %w", err)
		}
		for i, u := range undelivered {
			if u {
				delete(first, ask[i].agg)
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
	return ids, nil
}

// queryScan runs one claim statement on q, a pool or a connection, and
// hands its rows to scan.
func queryScan(ctx context.Context, q querier, query string, args []any, scan func(resultRows) error) error {
	res, err := q.query(ctx, query, args...)
	if err != nil {
		return err
	}
	err = scan(res)
	if cerr := res.Close(); err == nil {
		err = cerr
	}
	return err
}

func leaseArgs(dl dialect, a claimArgs) []any {
	end := dl.timeArg(a.leaseEnd)
	return []any{a.batchID, end, end, dl.timeArg(a.now)}
}

// claimResult is what one claim took.
type claimResult struct {
	batchID string
	rows    []claimed // oldest first
	// more reports whether due rows may remain that the claim did not
	// take for want of room, or because its window of slots stopped at
	// its bound: then the dispatcher should claim again at once rather
	// than wait for a wake-up.
	more bool
	// heldBack reports whether the claim may have stepped over due rows
	// that it could not take, in the window of slots (0: of all slots).
	heldBack bool
	slots    uint64
	// park reports whether parking (parkBlocked) may help: the claim held
	// back rows of a window that is this dispatcher's to park, its own
	// slots' or, when it holds no slots, all slots'. Rows that a
	// dispatcher with slots held back in the window of all slots, read
	// because its own had nothing due, are the other holders' to park,
	// and mostly in their flight: looking for their blockers found none
	// and cost about a second of the server's time per look in
	// four-dispatcher drains.
	park bool
}

// claim leases up to the batch size of due rows in short transactions
// (see above), under a fresh batch id. A dispatcher that holds some of the
// slots but not all (slots.go) reads the window of its own slots first,
// and the window of all slots only when its own have nothing due.
func (d *Dispatcher) claim(ctx context.Context) (claimResult, error) {
	now := time.Now()
	a := claimArgs{
		now:      now,
		leaseEnd: now.Add(d.lease),
		batchID:  uuid.Must(uuid.NewV7()).String(),
		limit:    d.batchSize,
		plan:     d.planTag(),
	}
	own := d.ownSlots()
	r := claimResult{batchID: a.batchID}
	if own == 0 && now.UnixNano() < d.runsUntil.Load() {
		rows, err := d.claimRuns(ctx, a)
		if err != nil {
			return claimResult{}, err
		}
		r.rows, r.more, r.heldBack, r.park = sortByID(rows), len(rows) == a.limit, true, true
		return r, nil
	}
	// read leases what the window of slots (0: all) allows, up to what is
	// left of the batch, and returns how many rows the window held.
	read := func(slots uint64) (int, error) {
		w := a
		w.limit = a.limit - len(r.rows)
		rows, seen, err := d.claimOldest(ctx, w, slots)
		if err != nil {
			return 0, err
		}
		if len(rows) < seen {
			r.heldBack, r.slots, r.park = true, slots, slots != 0 || own == 0
		}
		r.rows = append(r.rows, rows...)
		// A window of slots may be short for want of its rows among the
		// oldest (slotScan) rather than of due rows: look again at once.
		r.more = r.more || (len(rows) > 0 && (seen == w.limit || slots != 0))
		return seen, nil
	}
	fill := true
	if own != 0 {
		seen, err := read(own)
		if err != nil {
			return claimResult{}, fmt.Errorf("outbox: claim: %w", err)
		}
		// Only when its own slots have nothing due (among the rows the
		// window looks at): filling a short window from the oldest rows
		// of all slots takes the rows that their holders are about to
		// claim, holds those back in turn, and sets every dispatcher on
		// each other's aggregates again (measured: four dispatchers
		// drained 14k-17k events/s so, against 23k-27k).
		fill = seen == 0
	}
	if fill && len(r.rows) < a.limit {
		if _, err := read(0); err != nil {
			if len(r.rows) == 0 {
				return claimResult{}, fmt.Errorf("outbox: claim: %w", err)
			}
			d.log.Warn("outbox: could not fill a batch from all slots; dispatching what the claim took", "batch_id", a.batchID, "error", err)
			r.rows = sortByID(r.rows)
			return r, nil
		}
	}
	if !r.heldBack || len(r.rows) == a.limit {
		// Nothing held back, or no room left.
		r.rows = sortByID(r.rows)
		return r, nil
	}
	// A window held back some of its rows: other dispatchers hold their
	// aggregates, or their heads wait for a retry, or come after the
	// window in due order. Top the batch up by runs, and if runs found
	// anything, claim by runs alone for a while while this dispatcher
	// holds no slots: a window that stays held back would be read again,
	// and topped up again, at every claim.
	taken := len(r.rows)
	a.limit -= taken
	a.plan = d.planTag() // after the windows' ids
	runs, err := d.claimRuns(ctx, a)
	switch {
	case err != nil && taken == 0:
		return claimResult{}, err
	case err != nil:
		d.log.Warn("outbox: could not top up a batch by runs; dispatching what the claim took", "batch_id", a.batchID, "error", err)
		r.rows, r.more = sortByID(r.rows), true
		return r, nil
	case len(runs) > 0:
		d.runsUntil.Store(now.Add(runsPolls * d.pollInterval).UnixNano())
	}
	r.rows, r.more = sortByID(append(r.rows, runs...)), r.more || len(runs) == a.limit
	return r, nil
}

// runsPolls is for how many poll intervals a dispatcher claims by runs
// alone after finding the oldest due rows held back.
const runsPolls = 10

// claimRuns leases up to a.limit rows as runs.
func (d *Dispatcher) claimRuns(ctx context.Context, a claimArgs) (rows []claimed, err error) {
	err = d.d.claimRuns(ctx, d.db, d.t, a, func(res resultRows) error {
		rows, err = scanLeased(res, a.limit)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	for _, r := range rows {
		d.sawID(r.id)
	}
	return rows, nil
}

// scanLeased reads the rows leaseSQL returns; want is how many it expects.
// A row whose message cannot be built (headers that are not a JSON object
// of strings, a timestamp the driver cannot read: rows written by hand or
// by another program) is returned with bad set, to be dead-lettered, not
// published: failing the claim would leave it at the head of the due rows,
// failing every claim after it.
func scanLeased(res resultRows, want int) ([]claimed, error) {
	rows := make([]claimed, 0, want)
	for res.Next() {
		var (
			r       claimed
			payload []byte
			headers sql.NullString
			at      any
			started sql.NullString
		)
		dest := []any{&r.id, &r.msg.EventID, &r.msg.EventType, &r.msg.AggregateType, &r.msg.AggregateID,
			&r.msg.Sequence, &r.msg.IdempotencyKey, &payload, &headers, &at, &r.attempts, &started}
		if err := res.Scan(dest...); err != nil {
			return nil, fmt.Errorf("scan: %w", err)
		}
		r.serverStart = started.String
		r.msg.Payload = payload
		r.msg.Attempt = r.attempts + 1
		var occurred scanTime
		if err := occurred.Scan(at); err != nil {
			r.bad = fmt.Errorf("occurred_at: %w", err)
		}
		r.msg.OccurredAt = occurred.Time
		if headers.Valid {
			if err := json.Unmarshal([]byte(headers.String), &r.msg.Headers); err != nil {
				r.bad = fmt.Errorf("headers: %w", err)
			}
		}
		if r.bad != nil {
			r.bad = Permanent(fmt.Errorf("%w: event %s: %w", errUnreadable, r.msg.EventID, r.bad))
		}
		rows = append(rows, r)
	}
	return rows, res.Err()
}

// errUnreadable is wrapped by the error that a row which cannot be read
// into a Message is dead-lettered with.
var errUnreadable = errors.New("outbox: event cannot be read")

// sortByID puts a batch oldest first; within an aggregate, ids follow
// sequences (writers of one aggregate are serialised by its sequence row).
func sortByID(rows []claimed) []claimed {
	sort.Slice(rows, func(i, j int) bool { return rows[i].id < rows[j].id })
	return rows
}

// parkBlocked moves the due rows behind an aggregate's head (its first
// undelivered event) that waits for a retry or was dead-lettered to when
// that head can move: the retry's time, or one lease from now for a dead
// letter (it comes back only through RetryFailed, which makes the rows
// behind it due again; the lease bounds the wait if it comes back some
// other way). Rows behind a head in flight are left alone: it settles
// within the publish timeout. Rows that came due before their head in due
// order (written while it waited, and not parked) are moved to the head's
// time, behind it: a window full of them would hold no row a claim can
// take. After a settle that came after its lease (see Order above), an
// aggregate's first undelivered event may sit before delivered ones;
// parking takes it for the head all the same, so that the events after
// the delivered ones, which a claim could take, may wait as long as it
// does (a lease at most behind a dead letter) when parking reaches them
// before a claim does.
//
// It looks at the window of due rows that a run claim looks at
// (scanWindow), in the slots the claim read (slotScan), and runs at most once per poll interval per
// dispatcher, after a claim that was not full and stepped over due rows it
// could not take (a claim that took every due row it saw leaves none
// behind a blocker) in a window that is its to park (claimResult.park): in
// normal operation it finds nothing, and costs one
// statement, which finds each aggregate's head by walking its index
// entries (up to a second per call in a drain of 200k events by four
// dispatchers). It is an optimisation, so it never fails a dispatch: an
// error is logged. It reports whether it moved any row.
func (d *Dispatcher) parkBlocked(ctx context.Context, slots uint64) (parked bool) {
	now := time.Now()
	last := d.lastPark.Load()
	if last != 0 && now.Sub(time.Unix(0, last)) < d.pollInterval {
		return false
	}
	if !d.lastPark.CompareAndSwap(last, now.UnixNano()) {
		return false
	}
	blockers, err := d.blockers(ctx, now, slots)
	moved := int64(0)
	if err == nil {
		moved, err = d.park(ctx, blockers, now)
	}
	if err != nil {
		d.log.Warn("outbox: could not park the rows behind events that wait; claims step over them meanwhile", "error", err)
	}
	return moved > 0
}

// blocker is the head of an aggregate (its first undelivered event) that
// holds back due events of its aggregate, and until when those should
// wait: a head that waits for a retry (until its time) or for RetryFailed
// (for one lease), or a due head that the window of due rows does not
// reach because those events come before it in due order (until its time,
// which puts them behind it).
type blocker struct {
	aggregateType, aggregateID string
	sequence                   int64
	state                      string
	until                      scanTime
}

// blockers finds the blocking heads of the aggregates seen in the window of
// due rows. The head, not the event just before the window's first row of
// the aggregate: that one may be due itself but outside the window, behind
// rows written while it was parked. A due head outside the window is a
// blocker too: the rows of its aggregate that come before it in due order
// would otherwise fill every claim's window with rows no claim can take.
// Every lookup is a scalar subquery, run once per aggregate through the
// aggregate index: joined instead, the planner may drive the query from
// the heads' condition, which statistics taken when the backlog was due
// misjudge, and scan every row that is not due (seen: a quarter of a
// second per call on a backlog of 200,000).
func (d *Dispatcher) blockers(ctx context.Context, now time.Time, slots uint64) ([]blocker, error) {
	t := d.t
	ts := d.d.timeArg(now)
	slotCol, inSlots, args := "", "", []any{ts, scanWindow(d.batchSize)}
	if slots != 0 {
		l := d.d.slotLocks()
		slotCol, inSlots = `, `+l.slotOf("r")+` AS slot`, `WHERE `+l.inSlots("c.slot")
		args = []any{ts, slotScan(scanWindow(d.batchSize), slots), int64(slots)}
	}
	args = append(args, ts, d.d.timeArg(now.Add(d.lease)))
	res, err := d.db.Statement.ConnPool.QueryContext(ctx, d.planTag()+d.d.bind(`WITH seen AS MATERIALIZED (
	SELECT c.aggregate_type AS bt, c.aggregate_id AS ba, min(c.aggregate_sequence) AS ws FROM (
		SELECT r.aggregate_type, r.aggregate_id, r.aggregate_sequence`+slotCol+` FROM `+t.records+` r
		WHERE `+dueSQL("r")+`
		ORDER BY r.next_attempt_at, r.id
		LIMIT ?
	) c `+inSlots+`
	GROUP BY c.aggregate_type, c.aggregate_id
	HAVING max(c.aggregate_sequence) > 1
), heads AS MATERIALIZED (
	SELECT bt, ba, ws, (SELECT min(m.aggregate_sequence) FROM `+t.records+` m
		WHERE m.aggregate_type = bt AND m.aggregate_id = ba AND m.delivery_state <> 'delivered') AS hs
	FROM seen
), waits AS MATERIALIZED (
	SELECT bt, ba, hs, (SELECT CASE
			WHEN h.delivery_state = 'failed' THEN 'failed'
			WHEN h.delivery_state IN ('pending', 'retry') AND (h.next_attempt_at > ? OR hs < ws) THEN h.delivery_state
		END FROM `+t.records+` h
		WHERE h.aggregate_type = bt AND h.aggregate_id = ba AND h.aggregate_sequence = hs
			AND h.delivery_state <> 'delivered') AS state
	FROM heads
	WHERE hs IS NOT NULL
)
SELECT bt, ba, hs, state, CASE WHEN state = 'failed' THEN ? ELSE (SELECT h.next_attempt_at FROM `+t.records+` h
		WHERE h.aggregate_type = bt AND h.aggregate_id = ba AND h.aggregate_sequence = hs) END
FROM waits WHERE state IS NOT NULL`), args...)
	if err != nil {
		return nil, err
	}
	defer res.Close()
	var out []blocker
	for res.Next() {
		var b blocker
		if err := res.Scan(&b.aggregateType, &b.aggregateID, &b.sequence, &b.state, &b.until); err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return out, res.Err()
}

// park moves the due rows behind each blocker that come before its time
// to that time, one statement per blocker through the aggregate index,
// provided the blocker is still in the state it was read in: RetryFailed
// may have brought a dead letter back meanwhile (and made the rows behind
// it due), or a claim taken the head. It returns how many rows it moved.
func (d *Dispatcher) park(ctx context.Context, blockers []blocker, now time.Time) (moved int64, err error) {
	if len(blockers) == 0 {
		return 0, nil
	}
	query := d.planTag() + d.d.bind(`UPDATE `+d.t.records+` SET next_attempt_at = ?, updated_at = ?
WHERE aggregate_type = ? AND aggregate_id = ? AND aggregate_sequence > ?
	AND delivery_state IN ('pending', 'retry') AND next_attempt_at < ?
	AND EXISTS (SELECT 1 FROM `+d.t.records+` h
		WHERE h.aggregate_type = ? AND h.aggregate_id = ? AND h.aggregate_sequence = ?
			AND h.delivery_state = ?)`)
	ts := d.d.timeArg(now)
	for _, b := range blockers {
		until := d.d.timeArg(b.until.Time)
		res, err := d.db.Statement.ConnPool.ExecContext(ctx, query,
			until, ts, b.aggregateType, b.aggregateID, b.sequence, until,
			b.aggregateType, b.aggregateID, b.sequence, b.state)
		if err != nil {
			return moved, fmt.Errorf("park %s/%s: %w", b.aggregateType, b.aggregateID, err)
		}
		if n, err := res.RowsAffected(); err == nil {
			moved += n
		}
	}
	return moved, nil
}
