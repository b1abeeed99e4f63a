package outboxinspect

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dialect"
)

// Kinds of [Violation], one per promise [Inspector.Check] verifies.
const (
	// ViolationSequenceGap: an aggregate's remaining rows do not count
	// 1, 2, 3, ... up to the last sequence its sequence row holds (a
	// sequence missing between or above them, one used twice, or rows
	// without a sequence row or beyond it).
	ViolationSequenceGap = "sequence-gap"
	// ViolationOrder: a delivered message follows, in its aggregate, an
	// undelivered one that no late settle explains (one no claim has
	// taken since it was written or requeued).
	ViolationOrder = "order"
	// ViolationExpiredLease: a delivering row's lease ended longer ago
	// than CheckOptions.LeaseGrace: no dispatcher is claiming it again.
	ViolationExpiredLease = "expired-lease"
	// ViolationDuplicateKey: two rows share an idempotency key or an
	// event id.
	ViolationDuplicateKey = "duplicate-key"
	// ViolationDueAge: the oldest due message has waited longer than
	// CheckOptions.MaxDueAge.
	ViolationDueAge = "due-age"
)

// Defaults of [CheckOptions].
const (
	DefaultCheckLeaseGrace = time.Minute
	DefaultCheckMaxDueAge  = 5 * time.Minute
	// CheckViolationLimit is the most violations of one kind that one
	// Check reports.
	CheckViolationLimit = 100
)

// CheckOptions are the thresholds of [Inspector.Check]. The zero value
// takes the defaults.
type CheckOptions struct {
	// LeaseGrace is how long after its lease ended a delivering row may
	// wait to be claimed again (default DefaultCheckLeaseGrace). A
	// running dispatcher claims it at its next poll.
	LeaseGrace time.Duration
	// MaxDueAge is how long the oldest due message may have waited
	// (default DefaultCheckMaxDueAge); negative turns this check off, for
	// a table no dispatcher is draining.
	MaxDueAge time.Duration
}

// Violation is one broken promise that [Inspector.Check] found.
type Violation struct {
	// Kind is one of the Violation... constants.
	Kind string `json:"kind"`
	// AggregateType and AggregateID name the aggregate concerned, when
	// the violation has one.
	AggregateType string `json:"aggregate_type,omitempty"`
	AggregateID   string `json:"aggregate_id,omitempty"`
	// EventID names the message concerned, when there is one.
	EventID string `json:"event_id,omitempty"`
	// Detail says what was found, for a person.
	Detail string `json:"detail"`
}

// String returns the violation on one line.
func (v Violation) String() string {
	var b strings.Builder
	b.WriteString(v.Kind)
	if v.AggregateType != "" || v.AggregateID != "" {
		fmt.Fprintf(&b, " aggregate %s/%s", v.AggregateType, v.AggregateID)
	}
	if v.EventID != "" {
		fmt.Fprintf(&b, " event %s", v.EventID)
	}
	b.WriteString(": ")
	b.WriteString(v.Detail)
	return b.String()
}

// Check verifies the outbox's promises on the live table and returns every
// violation it finds (at most CheckViolationLimit of each kind), none when
// the table is healthy. Run it after a chaos test, once the dispatchers
// have drained what they could. The promises:
//
//   - Sequences: per aggregate, the remaining rows, with those above
//     the lowest of them that [outbox.Dispatcher.Discard] moved to the
//     discarded table, hold every sequence from the lowest of them up to
//     the aggregate's last sequence (the sequence table), each once. Sequences below the lowest remaining
//     row are allowed to be missing: Cleanup deletes delivered rows,
//     oldest delivery first. (Cleanup after a late settle's redelivery
//     may delete a later sequence before an earlier one; Check then
//     reports that gap too.)
//   - Order: no delivered row follows, in its aggregate, a pending row
//     that no claim has taken since it was written or requeued (its
//     batch_id is empty): nothing after such a row was ever allowed out.
//     A row that a claim took (delivering, retry, failed, or pending
//     again because a publisher did not attempt it) may precede delivered
//     ones: its publish may have been accepted and its settle lost or
//     late (the lease ended first), which lets the later events go while
//     it is delivered again. (A dead letter requeued after such a late
//     settle has an empty batch_id again, and is reported.)
//   - Leases: no delivering row whose lease ended longer ago than
//     LeaseGrace.
//   - Keys: every idempotency key and every event id once.
//   - Lag: the oldest due message (pending, retry, or delivering past its
//     lease, and due) has waited at most MaxDueAge.
//
// It reads the whole table, so run it at human rates. An error means the
// check could not run, not that the table is unhealthy.
func (in *Inspector) Check(ctx context.Context, o CheckOptions) ([]Violation, error) {
	if o.LeaseGrace <= 0 {
		o.LeaseGrace = DefaultCheckLeaseGrace
	}
	if o.MaxDueAge == 0 {
		o.MaxDueAge = DefaultCheckMaxDueAge
	}
	now := time.Now()
	var out []Violation
	for _, step := range []func(context.Context, time.Time, CheckOptions) ([]Violation, error){
		in.checkSequences, in.checkOrder, in.checkLeases, in.checkKeys, in.checkDueAge,
	} {
		vs, err := step(ctx, now, o)
		if err != nil {
			return out, fmt.Errorf("outbox: check: %w", err)
		}
		out = append(out, vs...)
	}
	return out, nil
}

func (in *Inspector) checkSequences(ctx context.Context, _ time.Time, _ CheckOptions) ([]Violation, error) {
	rows, err := in.db.Statement.ConnPool.QueryContext(ctx, in.d.Bind(`SELECT r.aggregate_type, r.aggregate_id,
	min(r.aggregate_sequence), max(r.aggregate_sequence), count(*), count(DISTINCT r.aggregate_sequence),
	max(s.last_sequence), count(s.last_sequence)
FROM (SELECT aggregate_type, aggregate_id, aggregate_sequence FROM `+in.t.Records+`
	UNION ALL SELECT x.aggregate_type, x.aggregate_id, x.aggregate_sequence FROM `+in.discarded()+` x
	WHERE x.aggregate_sequence > (SELECT min(m.aggregate_sequence) FROM `+in.t.Records+` m
		WHERE m.aggregate_type = x.aggregate_type AND m.aggregate_id = x.aggregate_id)) r
LEFT JOIN `+in.t.Sequences+` s
	ON s.aggregate_type = r.aggregate_type AND s.aggregate_id = r.aggregate_id
GROUP BY r.aggregate_type, r.aggregate_id
HAVING count(*) <> max(r.aggregate_sequence) - min(r.aggregate_sequence) + 1
	OR count(DISTINCT r.aggregate_sequence) <> count(*)
	OR count(s.last_sequence) = 0
	OR max(s.last_sequence) <> max(r.aggregate_sequence)
ORDER BY r.aggregate_type, r.aggregate_id
LIMIT ?`), CheckViolationLimit)
	if err != nil {
		return nil, fmt.Errorf("sequences: %w", err)
	}
	defer rows.Close()
	var out []Violation
	for rows.Next() {
		var (
			v                           Violation
			lo, hi, n, distinct, hasSeq int64
			lastSeq                     sql.NullInt64
		)
		if err := rows.Scan(&v.AggregateType, &v.AggregateID, &lo, &hi, &n, &distinct, &lastSeq, &hasSeq); err != nil {
			return nil, fmt.Errorf("sequences: %w", err)
		}
		last := lastSeq.Int64
		v.Kind = ViolationSequenceGap
		var parts []string
		if missing := hi - lo + 1 - distinct; missing > 0 {
			parts = append(parts, fmt.Sprintf("%d sequence(s) missing between %d and %d", missing, lo, hi))
		}
		if distinct != n {
			parts = append(parts, fmt.Sprintf("%d row(s) repeat a sequence", n-distinct))
		}
		switch {
		case hasSeq == 0:
			parts = append(parts, "no row in the sequence table")
		case last > hi:
			parts = append(parts, fmt.Sprintf("sequences %d to %d missing above the highest row", hi+1, last))
		case last < hi:
			parts = append(parts, fmt.Sprintf("rows up to sequence %d beyond the last sequence %d", hi, last))
		}
		v.Detail = strings.Join(parts, "; ")
		out = append(out, v)
	}
	return out, rows.Err()
}

func (in *Inspector) checkOrder(ctx context.Context, _ time.Time, _ CheckOptions) ([]Violation, error) {
	rows, err := in.db.Statement.ConnPool.QueryContext(ctx, in.d.Bind(`SELECT l.aggregate_type, l.aggregate_id, l.event_id,
	l.aggregate_sequence, min(e.aggregate_sequence), count(*)
FROM `+in.t.Records+` l JOIN `+in.t.Records+` e
	ON e.aggregate_type = l.aggregate_type AND e.aggregate_id = l.aggregate_id
	AND e.aggregate_sequence < l.aggregate_sequence
WHERE l.delivery_state = 'delivered' AND e.delivery_state = 'pending' AND e.batch_id IS NULL
GROUP BY l.aggregate_type, l.aggregate_id, l.event_id, l.aggregate_sequence
ORDER BY l.aggregate_type, l.aggregate_id, l.aggregate_sequence
LIMIT ?`), CheckViolationLimit)
	if err != nil {
		return nil, fmt.Errorf("order: %w", err)
	}
	defer rows.Close()
	var out []Violation
	for rows.Next() {
		var (
			v          Violation
			seq, first int64
			n          int64
		)
		if err := rows.Scan(&v.AggregateType, &v.AggregateID, &v.EventID, &seq, &first, &n); err != nil {
			return nil, fmt.Errorf("order: %w", err)
		}
		v.Kind = ViolationOrder
		v.Detail = fmt.Sprintf("sequence %d is delivered while %d earlier one(s) were never claimed, from sequence %d", seq, n, first)
		out = append(out, v)
	}
	return out, rows.Err()
}

func (in *Inspector) checkLeases(ctx context.Context, now time.Time, o CheckOptions) ([]Violation, error) {
	rows, err := in.db.Statement.ConnPool.QueryContext(ctx, in.d.Bind(`SELECT aggregate_type, aggregate_id, event_id, `+
		in.d.ReadTime("locked_until")+`
FROM `+in.t.Records+`
WHERE delivery_state = 'delivering' AND (locked_until IS NULL OR locked_until < ?)
ORDER BY locked_until, id
LIMIT ?`), in.d.TimeArg(now.Add(-o.LeaseGrace)), CheckViolationLimit)
	if err != nil {
		return nil, fmt.Errorf("leases: %w", err)
	}
	defer rows.Close()
	var out []Violation
	for rows.Next() {
		var (
			v     Violation
			until dialect.Time
		)
		if err := rows.Scan(&v.AggregateType, &v.AggregateID, &v.EventID, &until); err != nil {
			return nil, fmt.Errorf("leases: %w", err)
		}
		v.Kind = ViolationExpiredLease
		if until.Time.IsZero() {
			v.Detail = "delivering without a lease"
		} else {
			v.Detail = fmt.Sprintf("lease ended %s ago (at %s), more than %s",
				now.Sub(until.Time).Round(time.Second), until.Time.UTC().Format(time.RFC3339), o.LeaseGrace)
		}
		out = append(out, v)
	}
	return out, rows.Err()
}

func (in *Inspector) checkKeys(ctx context.Context, _ time.Time, _ CheckOptions) ([]Violation, error) {
	var out []Violation
	for _, column := range []string{"idempotency_key", "event_id"} {
		rows, err := in.db.Statement.ConnPool.QueryContext(ctx, in.d.Bind(`SELECT `+column+`, count(*) FROM `+in.t.Records+`
GROUP BY `+column+` HAVING count(*) > 1 ORDER BY `+column+` LIMIT ?`), CheckViolationLimit)
		if err != nil {
			return nil, fmt.Errorf("keys: %w", err)
		}
		for rows.Next() {
			var (
				key string
				n   int64
			)
			if err := rows.Scan(&key, &n); err != nil {
				rows.Close()
				return nil, fmt.Errorf("keys: %w", err)
			}
			v := Violation{Kind: ViolationDuplicateKey, Detail: fmt.Sprintf("%s %q is held by %d rows", column, key, n)}
			if column == "event_id" {
				v.EventID = key
			}
			out = append(out, v)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, fmt.Errorf("keys: %w", err)
		}
	}
	return out, nil
}

func (in *Inspector) checkDueAge(ctx context.Context, now time.Time, o CheckOptions) ([]Violation, error) {
	if o.MaxDueAge < 0 {
		return nil, nil
	}
	var (
		v      Violation
		oldest dialect.Time
	)
	err := in.db.Statement.ConnPool.QueryRowContext(ctx, in.d.Bind(`SELECT aggregate_type, aggregate_id, event_id, `+
		in.d.ReadTime("next_attempt_at")+` FROM `+in.t.Records+`
WHERE delivery_state IN ('pending', 'retry', 'delivering') AND next_attempt_at <= ?
	AND (delivery_state <> 'delivering' OR locked_until IS NULL OR locked_until <= ?)
ORDER BY next_attempt_at, id LIMIT 1`), in.d.TimeArg(now), in.d.TimeArg(now)).Scan(&v.AggregateType, &v.AggregateID, &v.EventID, &oldest)
	if err != nil {
		if errors.Is(err, sql.ErrNoRows) {
			return nil, nil
		}
		return nil, fmt.Errorf("due age: %w", err)
	}
	if age := now.Sub(oldest.Time); age > o.MaxDueAge {
		v.Kind = ViolationDueAge
		v.Detail = fmt.Sprintf("due for %s, more than %s", age.Round(time.Second), o.MaxDueAge)
		return []Violation{v}, nil
	}
	return nil, nil
}

// discarded is the quoted name of the table of discarded events.
func (in *Inspector) discarded() string {
	return in.t.Quote(in.t.Name + outbox.DiscardedTableSuffix)
}
