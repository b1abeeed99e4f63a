package outbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"sort"
	"time"

	"github.com/google/uuid"
)

// The claim takes runs, not rows. A run is the due prefix of one
// aggregate's undelivered events: it starts at the aggregate's head (its
// first undelivered event) and goes on in sequence order, without gaps, up
// to the first event that is not due (waiting for a retry, in flight,
// dead-lettered). The claim picks heads oldest first, through the due index
// in its order (next_attempt_at, id), and takes each head's run until the
// batch is full.
//
// Order per aggregate follows without anything else to check: a row that
// is not a head is claimable only as part of its head's run, and a run is
// leased in one statement (a full batch may end inside it, and the rest is
// a later run), so while one dispatcher holds an aggregate's run no other
// dispatcher sees a head for that aggregate. Dispatchers working on
// one backlog therefore split it by aggregate instead of colliding on
// overlapping windows of rows, and a claim writes exactly the rows it
// leases.
//
// Rows that are due but not heads are stepped over by the head scan, which
// looks at a bounded window of due rows (scanWindow). Those behind a run in
// flight stay: it settles within the publish timeout. Those behind a head
// that waits for a retry or was dead-lettered are moved out of the due
// range by parkBlocked until their head can move, so that a long outage
// does not fill every claim's window with everything that arrived during
// it.

// claimArgs are the values one claim works with.
type claimArgs struct {
	now      time.Time
	leaseEnd time.Time
	batchID  string
	limit    int
}

// dueSQL is the due predicate on the records table alias a: pending or
// retry rows whose time has come, and delivering rows whose lease has
// passed (a claim sets next_attempt_at to the lease's end). It takes one
// argument, now. The due index serves it in its order.
func dueSQL(a string) string {
	return a + `.delivery_state IN ('pending', 'retry', 'delivering') AND ` + a + `.next_attempt_at <= ?`
}

// headsSQL selects heads oldest first: due rows with no undelivered
// predecessor in their aggregate (the first event of an aggregate has none
// to look for), among the first window due rows. The window bounds what a
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
				AND p.aggregate_sequence < r.aggregate_sequence AND p.delivery_state <> 'delivered'))
	ORDER BY w.wnext, w.wid`
}

// scanWindow is how many due rows a claim of n looks at for heads, and
// parkBlocked for rows to park: enough to pass by the runs several other
// dispatchers hold.
func scanWindow(n int) int { return max(4*n, 1000) }

// leaseSQL is the UPDATE that leases the picked rows, given the condition
// that names them, and returns what a Message needs. Its arguments are
// batch id, lease end, lease end, now, then those of where.
func leaseSQL(t tables, where string) string {
	return `UPDATE ` + t.records + ` SET
	delivery_state = 'delivering', batch_id = ?, locked_until = ?, next_attempt_at = ?, updated_at = ?
WHERE ` + where + `
RETURNING id, event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence,
	idempotency_key, payload, headers, occurred_at, delivery_attempts`
}

func leaseArgs(dl dialect, a claimArgs) []any {
	end := dl.timeArg(a.leaseEnd)
	return []any{a.batchID, end, end, dl.timeArg(a.now)}
}

// claim leases up to the batch size of due rows, as runs (see above), in
// one short transaction, and returns them oldest first under a fresh batch
// id. On PostgreSQL it is one statement; heads are taken with FOR UPDATE
// SKIP LOCKED, so concurrent claims pass each other by.
func (d *Dispatcher) claim(ctx context.Context) (string, []claimed, error) {
	now := time.Now()
	a := claimArgs{
		now:      now,
		leaseEnd: now.Add(d.lease),
		batchID:  uuid.Must(uuid.NewV7()).String(),
		limit:    d.batchSize,
	}
	var rows []claimed
	err := d.d.claim(ctx, d.db, d.t, a, func(res *sql.Rows) error {
		for res.Next() {
			var (
				r       claimed
				payload []byte
				headers sql.NullString
				at      scanTime
			)
			if err := res.Scan(&r.id, &r.msg.EventID, &r.msg.EventType, &r.msg.AggregateType, &r.msg.AggregateID,
				&r.msg.Sequence, &r.msg.IdempotencyKey, &payload, &headers, &at, &r.attempts); err != nil {
				return fmt.Errorf("scan: %w", err)
			}
			r.msg.Payload = payload
			r.msg.OccurredAt = at.Time
			r.msg.Attempt = r.attempts + 1
			if headers.Valid {
				if err := json.Unmarshal([]byte(headers.String), &r.msg.Headers); err != nil {
					return fmt.Errorf("event %s: headers: %w", r.msg.EventID, err)
				}
			}
			rows = append(rows, r)
		}
		return res.Err()
	})
	if err != nil {
		return "", nil, fmt.Errorf("outbox: claim: %w", err)
	}
	// Oldest first; within an aggregate, ids follow sequences (writers of
	// one aggregate are serialised by its sequence row).
	sort.Slice(rows, func(i, j int) bool { return rows[i].id < rows[j].id })
	return a.batchID, rows, nil
}

// parkBlocked moves the due rows stepped over by the head scan, those
// behind a head that waits for a retry or was dead-lettered, to when that
// head can move: the retry's time, or one lease from now for a
// dead-lettered head (it comes back only through RetryFailed, which makes
// the pending rows behind it due again; the lease bounds the wait if it
// comes back some other way). Rows behind a head that is in flight are
// left alone: it settles within the publish timeout.
//
// It looks at the same window of due rows as a claim, and runs at most once
// per poll interval per dispatcher, after a batch that was not full: in
// normal operation it finds nothing, and costs one short scan. It is an
// optimisation, so it never fails a dispatch: an error is logged.
func (d *Dispatcher) parkBlocked(ctx context.Context) {
	now := time.Now()
	last := d.lastPark.Load()
	if last != 0 && now.Sub(time.Unix(0, last)) < d.pollInterval {
		return
	}
	if !d.lastPark.CompareAndSwap(last, now.UnixNano()) {
		return
	}
	t := d.t
	ts := d.d.timeArg(now)
	_, err := d.db.Statement.ConnPool.ExecContext(ctx, d.d.bind(`WITH seen AS (
	SELECT DISTINCT c.aggregate_type AS bt, c.aggregate_id AS ba FROM (
		SELECT r.aggregate_type, r.aggregate_id, r.aggregate_sequence FROM `+t.records+` r
		WHERE `+dueSQL("r")+`
		ORDER BY r.next_attempt_at, r.id
		LIMIT ?
	) c
	WHERE c.aggregate_sequence > 1
), blocker AS (
	SELECT bt, ba, h.aggregate_sequence AS hs,
		CASE WHEN h.delivery_state = 'failed' THEN ? ELSE h.next_attempt_at END AS until
	FROM seen JOIN `+t.records+` h ON h.aggregate_type = bt AND h.aggregate_id = ba
	WHERE h.delivery_state <> 'delivered'
		AND h.aggregate_sequence = (SELECT min(m.aggregate_sequence) FROM `+t.records+` m
			WHERE m.aggregate_type = bt AND m.aggregate_id = ba AND m.delivery_state <> 'delivered')
		AND (h.delivery_state = 'failed' OR (h.delivery_state IN ('pending', 'retry') AND h.next_attempt_at > ?))
)
UPDATE `+t.records+` SET next_attempt_at = blocker.until, updated_at = ?
FROM blocker
WHERE aggregate_type = bt AND aggregate_id = ba AND aggregate_sequence > hs
	AND delivery_state IN ('pending', 'retry') AND next_attempt_at < blocker.until`),
		ts, scanWindow(d.batchSize), d.d.timeArg(now.Add(d.lease)), ts, ts)
	if err != nil {
		d.log.Warn("outbox: could not park the rows behind events that wait; claims step over them meanwhile", "error", err)
	}
}
