// Package outboxinspect reads an outbox table for people and the tools
// they use: the messages a filter selects, one message whole, what a
// requeue would move, deliveries and failures over time, and a check of
// the outbox's promises on the live table. outboxctl and the outboxui
// dashboard are built on it. It only reads: what changes the table
// (Requeue, RetryFailed, Cleanup) is the dispatcher's.
package outboxinspect

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dialect"
)

// Inspector reads the table of one dispatcher. It holds no connection of
// its own and is safe for concurrent use.
type Inspector struct {
	db         *gorm.DB
	d          dialect.Dialect
	t          dialect.Tables
	sweepLimit int
}

// New returns an Inspector of d's table, through d's database. d must
// come from [outbox.NewDispatcher], which refuses the engines the
// Inspector cannot read; New panics otherwise.
func New(d *outbox.Dispatcher) *Inspector {
	if d == nil || d.DB() == nil {
		panic("outboxinspect: New: the dispatcher was not made by outbox.NewDispatcher")
	}
	db := d.DB()
	dl, err := dialect.For(db)
	if err != nil {
		panic(fmt.Sprintf("outboxinspect: New: %v", err))
	}
	return &Inspector{db: db, d: dl, t: dl.Tables(d.Table()), sweepLimit: d.SweepLimit()}
}

// Table returns the name of the outbox table the Inspector reads, as
// configured (unquoted).
func (in *Inspector) Table() string { return in.t.Name }

// ErrMessageNotFound is returned (wrapped) by [Inspector.Message] when no
// row of the outbox table has the event id asked for: it was never
// written, Cleanup deleted it after its delivery, or a person discarded
// it ([outbox.Dispatcher.Discard] moves it to the table
// <table>_discarded).
var ErrMessageNotFound = errors.New("outbox: message not found")

// Limits of [Inspector.Messages].
const (
	// DefaultMessageLimit is how many messages one call of
	// [Inspector.Messages] returns when the filter sets no limit.
	DefaultMessageLimit = 50
	// MaxMessageLimit is the most messages one call returns, whatever the
	// filter asks for.
	MaxMessageLimit = 10000
)

// MessageOrder is the order of the messages [Inspector.Messages] returns.
type MessageOrder int

// The orders of [Inspector.Messages].
const (
	// NewestFirst orders by row id, highest first: the last written first.
	// It is the default.
	NewestFirst MessageOrder = iota
	// OldestFirst orders by row id, lowest first: the first written first.
	OldestFirst
	// SequenceOrder orders by aggregate, then aggregate sequence, lowest
	// first: within one aggregate, the order in which it is delivered.
	SequenceOrder
)

// MessageFilter selects the rows that [Inspector.Messages] returns. Each
// field that is set narrows the selection; the zero value matches every
// row and returns the newest [DefaultMessageLimit] of them.
type MessageFilter struct {
	// States, when not empty, keeps the rows in one of these delivery
	// states (outbox.StatePending, outbox.StateFailed, ...).
	States []string
	// EventIDs, when not empty, keeps these events.
	EventIDs []string
	// EventTypes, when not empty, keeps the rows of these event types.
	EventTypes []string
	// AggregateType and AggregateID, each when not empty, keep the rows of
	// that aggregate type, and that aggregate id.
	AggregateType, AggregateID string
	// CreatedBefore and CreatedAfter, each when not zero, keep the rows
	// written (created_at) before, and at or after, that time.
	CreatedBefore, CreatedAfter time.Time
	// SequenceFrom and SequenceTo, each when not zero, keep the rows whose
	// aggregate sequence is at least, and at most, that number.
	SequenceFrom, SequenceTo int64
	// Order is the order of the result (default NewestFirst).
	Order MessageOrder
	// Limit bounds how many rows are returned (default, when zero or
	// negative, DefaultMessageLimit; at most MaxMessageLimit).
	Limit int
}

// MessageInfo is one row of the outbox table, as an operator reads it.
// Times that the row does not hold (a lease it has not got, a delivery
// that has not happened) are zero.
type MessageInfo struct {
	ID             int64             `json:"id"`
	EventID        string            `json:"event_id"`
	EventType      string            `json:"event_type"`
	AggregateType  string            `json:"aggregate_type"`
	AggregateID    string            `json:"aggregate_id"`
	Sequence       int64             `json:"aggregate_sequence"`
	IdempotencyKey string            `json:"idempotency_key"`
	Payload        json.RawMessage   `json:"payload"`
	Headers        map[string]string `json:"headers,omitempty"`
	State          string            `json:"delivery_state"`
	Attempts       int               `json:"delivery_attempts"`
	NextAttemptAt  time.Time         `json:"next_attempt_at"`
	BatchID        string            `json:"batch_id,omitempty"`
	LastError      string            `json:"last_error,omitempty"`
	LockedUntil    time.Time         `json:"locked_until,omitzero"`
	OccurredAt     time.Time         `json:"occurred_at"`
	CreatedAt      time.Time         `json:"created_at"`
	UpdatedAt      time.Time         `json:"updated_at"`
	DeliveredAt    time.Time         `json:"delivered_at,omitzero"`
}

// messageColumns names every column MessageInfo reads, so that a table
// with columns added later reads the same.
func (in *Inspector) messageColumns() string {
	return `id, event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence,
	idempotency_key, payload, headers, delivery_state, delivery_attempts, ` + in.d.ReadTime("next_attempt_at") + `,
	batch_id, last_error, ` + in.d.ReadTime("locked_until") + `, ` + in.d.ReadTime("occurred_at") + `,
	` + in.d.ReadTime("created_at") + `, ` + in.d.ReadTime("updated_at") + `, ` + in.d.ReadTime("delivered_at")
}

// Messages returns the rows that f selects, in f's order. It reads the
// table only; rows change under it as dispatchers work.
func (in *Inspector) Messages(ctx context.Context, f MessageFilter) ([]MessageInfo, error) {
	where, args := f.where(in)
	order := "id DESC"
	switch f.Order {
	case OldestFirst:
		order = "id"
	case SequenceOrder:
		order = "aggregate_type, aggregate_id, aggregate_sequence, id"
	}
	limit := f.Limit
	if limit <= 0 {
		limit = DefaultMessageLimit
	}
	limit = min(limit, MaxMessageLimit)
	msgs, err := in.queryMessages(ctx, where, order, limit, args)
	if err != nil {
		return nil, fmt.Errorf("outbox: messages: %w", err)
	}
	return msgs, nil
}

// Message returns the row of the event eventID, or an error wrapping
// [ErrMessageNotFound] when there is none.
func (in *Inspector) Message(ctx context.Context, eventID string) (MessageInfo, error) {
	msgs, err := in.queryMessages(ctx, []string{"event_id = ?"}, "id", 1, []any{eventID})
	if err != nil {
		return MessageInfo{}, fmt.Errorf("outbox: message %s: %w", eventID, err)
	}
	if len(msgs) == 0 {
		return MessageInfo{}, fmt.Errorf("%w: no event %q in %s", ErrMessageNotFound, eventID, in.t.Name)
	}
	return msgs[0], nil
}

// RequeueCandidates returns the failed rows that [outbox.Dispatcher.Requeue] with
// f would move now, in the order it takes them (oldest failure first) and
// with its limit: what a dry run shows. [outbox.Dispatcher.Discard] takes
// the same rows for the same filter.
func (in *Inspector) RequeueCandidates(ctx context.Context, f outbox.RequeueFilter) ([]MessageInfo, error) {
	mf := MessageFilter{States: []string{outbox.StateFailed}, EventIDs: f.EventIDs, EventTypes: f.EventTypes}
	where, args := mf.where(in)
	if !f.FailedBefore.IsZero() {
		where = append(where, "updated_at < ?")
		args = append(args, in.d.TimeArg(f.FailedBefore))
	}
	limit := f.Limit
	if limit <= 0 {
		limit = in.sweepLimit
	}
	msgs, err := in.queryMessages(ctx, where, "updated_at, id", limit, args)
	if err != nil {
		return nil, fmt.Errorf("outbox: requeue candidates: %w", err)
	}
	return msgs, nil
}

// PurgeCandidates counts the delivered rows that [outbox.Dispatcher.Cleanup]
// with a retention of olderThan would delete now: those delivered longer
// ago than olderThan. What a purge's dry run shows.
func (in *Inspector) PurgeCandidates(ctx context.Context, olderThan time.Duration) (int64, error) {
	var n int64
	err := in.db.Statement.ConnPool.QueryRowContext(ctx, in.d.Bind(`SELECT count(*) FROM `+in.t.Records+`
WHERE delivery_state = 'delivered' AND delivered_at < ?`), in.d.TimeArg(time.Now().Add(-olderThan))).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("outbox: purge candidates: %w", err)
	}
	return n, nil
}

// where returns f's conditions and their arguments.
func (f MessageFilter) where(in *Inspector) ([]string, []any) {
	var (
		where []string
		args  []any
	)
	oneOf := func(column string, values []string) {
		if len(values) == 0 {
			return
		}
		where = append(where, column+" IN (?"+strings.Repeat(", ?", len(values)-1)+")")
		for _, v := range values {
			args = append(args, v)
		}
	}
	oneOf("delivery_state", f.States)
	oneOf("event_id", f.EventIDs)
	oneOf("event_type", f.EventTypes)
	if f.AggregateType != "" {
		where = append(where, "aggregate_type = ?")
		args = append(args, f.AggregateType)
	}
	if f.AggregateID != "" {
		where = append(where, "aggregate_id = ?")
		args = append(args, f.AggregateID)
	}
	if !f.CreatedBefore.IsZero() {
		where = append(where, "created_at < ?")
		args = append(args, in.d.TimeArg(f.CreatedBefore))
	}
	if !f.CreatedAfter.IsZero() {
		where = append(where, "created_at >= ?")
		args = append(args, in.d.TimeArg(f.CreatedAfter))
	}
	if f.SequenceFrom != 0 {
		where = append(where, "aggregate_sequence >= ?")
		args = append(args, f.SequenceFrom)
	}
	if f.SequenceTo != 0 {
		where = append(where, "aggregate_sequence <= ?")
		args = append(args, f.SequenceTo)
	}
	return where, args
}

func (in *Inspector) queryMessages(ctx context.Context, where []string, order string, limit int, args []any) ([]MessageInfo, error) {
	q := `SELECT ` + in.messageColumns() + ` FROM ` + in.t.Records
	if len(where) > 0 {
		q += ` WHERE ` + strings.Join(where, " AND ")
	}
	q += ` ORDER BY ` + order + ` LIMIT ?`
	rows, err := in.db.Statement.ConnPool.QueryContext(ctx, in.d.Bind(q), append(args, limit)...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []MessageInfo
	for rows.Next() {
		var (
			m                                   MessageInfo
			payload                             []byte
			headers, batch, lastErr             sql.NullString
			next, locked, occurred, created, up dialect.Time
			delivered                           dialect.Time
		)
		if err := rows.Scan(&m.ID, &m.EventID, &m.EventType, &m.AggregateType, &m.AggregateID, &m.Sequence,
			&m.IdempotencyKey, &payload, &headers, &m.State, &m.Attempts, &next,
			&batch, &lastErr, &locked, &occurred, &created, &up, &delivered); err != nil {
			return nil, err
		}
		m.Payload = json.RawMessage(payload)
		if headers.Valid && headers.String != "" && headers.String != "null" {
			if err := json.Unmarshal([]byte(headers.String), &m.Headers); err != nil {
				return nil, fmt.Errorf("headers of event %s: %w", m.EventID, err)
			}
		}
		m.BatchID, m.LastError = batch.String, lastErr.String
		m.NextAttemptAt, m.LockedUntil, m.OccurredAt = next.Time, locked.Time, occurred.Time
		m.CreatedAt, m.UpdatedAt, m.DeliveredAt = created.Time, up.Time, delivered.Time
		out = append(out, m)
	}
	return out, rows.Err()
}

// ActivityBucket counts what happened to messages in one interval of
// [Inspector.Activity].
type ActivityBucket struct {
	// Start is when the interval begins; it ends where the next begins.
	Start time.Time `json:"start"`
	// Delivered counts the rows whose delivered_at falls in the interval.
	Delivered int64 `json:"delivered"`
	// Failed counts the rows in retry or failed whose last failed attempt
	// (updated_at) falls in the interval.
	Failed int64 `json:"failed"`
}

// Activity counts deliveries and failures in n consecutive intervals of
// length step that end now, oldest first, for a chart. A row counts once,
// for its latest delivery or failure: a row that failed and was delivered
// later counts as delivered only, and delivered rows that Cleanup deleted
// count no more. n must be between 1 and 1000 and step positive.
func (in *Inspector) Activity(ctx context.Context, step time.Duration, n int) ([]ActivityBucket, error) {
	if step <= 0 || n < 1 || n > 1000 {
		return nil, fmt.Errorf("%w: Activity: step %v and %d intervals", outbox.ErrInvalidOption, step, n)
	}
	end := time.Now()
	start := end.Add(-step * time.Duration(n))
	buckets := make([]ActivityBucket, n)
	for i := range buckets {
		buckets[i].Start = start.Add(step * time.Duration(i))
	}
	count := func(column, cond string, set func(*ActivityBucket, int64)) error {
		sums := make([]string, n)
		args := make([]any, 0, 2*n+2)
		for i := range buckets {
			sums[i] = `sum(CASE WHEN ` + column + ` >= ? AND ` + column + ` < ? THEN 1 ELSE 0 END)`
			to := end
			if i+1 < n {
				to = buckets[i+1].Start
			}
			args = append(args, in.d.TimeArg(buckets[i].Start), in.d.TimeArg(to))
		}
		args = append(args, in.d.TimeArg(start))
		dest := make([]any, n)
		vals := make([]sql.NullInt64, n)
		for i := range vals {
			dest[i] = &vals[i]
		}
		if err := in.db.Statement.ConnPool.QueryRowContext(ctx, in.d.Bind(`SELECT `+strings.Join(sums, ", ")+
			` FROM `+in.t.Records+` WHERE `+cond+` AND `+column+` >= ?`), args...).Scan(dest...); err != nil {
			return fmt.Errorf("outbox: activity: %w", err)
		}
		for i, v := range vals {
			set(&buckets[i], v.Int64)
		}
		return nil
	}
	if err := count("delivered_at", "delivery_state = 'delivered'", func(b *ActivityBucket, v int64) { b.Delivered = v }); err != nil {
		return nil, err
	}
	if err := count("updated_at", "delivery_state IN ('retry', 'failed')", func(b *ActivityBucket, v int64) { b.Failed = v }); err != nil {
		return nil, err
	}
	return buckets, nil
}
