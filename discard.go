package outbox

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// DiscardedTableSuffix names the table beside the outbox table that keeps
// the events [Dispatcher.Discard] took out of delivery: <table>_discarded
// (outbox_records_discarded by default), created by migration 4.
const DiscardedTableSuffix = "_discarded"

// discardChunk is how many rows one statement of a discard moves, so that
// a large Limit stays within every engine's count of placeholders.
const discardChunk = 500

// Discard is a person's decision that dead letters will never be
// delivered: it takes the failed rows that f selects (the same selection
// as [Dispatcher.Requeue]: the zero filter selects every failed row, up to
// f.Limit or the sweep limit, oldest failure first) out of delivery for
// good, and returns how many it took. Rows in any other state are never
// touched, whatever f names.
//
// Each discarded row moves, in one transaction, from the outbox table to
// <table>_discarded (see [DiscardedTableSuffix]), which keeps its event
// whole (payload, headers, attempts, last error, failure kind) with when
// it failed and when it was discarded, for people to read; nothing in the
// library reads it back into delivery or deletes it. Once moved, the event
// no longer holds back its aggregate: the later events of the aggregate,
// parked behind it, are made due at once and are delivered next, in
// order. [Dispatcher.Requeue] and [Dispatcher.RetryFailed] never see it
// again, and no dispatcher delivers it. Its idempotency key is free
// again, as after [Dispatcher.Cleanup]: a write with the same key is a
// new event. Each discarded event is logged (Info) with its id, type,
// aggregate and sequence.
//
// It needs schema version 4 ([AutoMigrate]). outboxctl discard and the
// outboxui dashboard call it.
func (d *Dispatcher) Discard(ctx context.Context, f RequeueFilter) (int, error) {
	var taken []discardedRow
	err := d.d.ClaimTx(ctx, d.db, func(q dialect.Querier) error {
		var err error
		taken, err = d.discardSelected(ctx, q, f)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("outbox: discard: %w", err)
	}
	if len(taken) == 0 {
		return 0, nil
	}
	released := map[dialect.Aggregate]bool{}
	for _, r := range taken {
		released[r.agg] = true
		d.log.Info("outbox: dead-lettered event discarded", "event_id", r.eventID, "event_type", r.eventType,
			"aggregate_type", r.agg.Type, "aggregate_id", r.agg.ID, "sequence", r.seq)
	}
	d.unpark(ctx, released, time.Now())
	d.Notify()
	return len(taken), nil
}

// discardedRow is a failed row that a discard took.
type discardedRow struct {
	id                 int64
	eventID, eventType string
	agg                dialect.Aggregate
	seq                int64
}

// discardSelected locks the failed rows f selects (Statements.Discard),
// oldest failure first, copies them into the discarded table and deletes
// them, on q, inside the discard's transaction. It returns the rows it moved.
func (d *Dispatcher) discardSelected(ctx context.Context, q dialect.Querier, f RequeueFilter) ([]discardedRow, error) {
	rows, err := q.QueryContext(ctx, d.st.Discard, d.filterArgs(f)...)
	if err != nil {
		return nil, fmt.Errorf("select: %w", err)
	}
	var taken []discardedRow
	for rows.Next() {
		var r discardedRow
		if err := rows.Scan(&r.id, &r.eventID, &r.eventType, &r.agg.Type, &r.agg.ID, &r.seq); err != nil {
			rows.Close()
			return nil, fmt.Errorf("select: %w", err)
		}
		taken = append(taken, r)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("select: %w", err)
	}
	discarded := d.t.Quote(d.t.Name + DiscardedTableSuffix)
	now := d.d.TimeArg(time.Now())
	for start := 0; start < len(taken); start += discardChunk {
		chunk := taken[start:min(start+discardChunk, len(taken))]
		ids := make([]any, len(chunk))
		for i, r := range chunk {
			ids[i] = r.id
		}
		in := `id IN (` + placeholders(len(ids)) + `) AND delivery_state = 'failed'`
		if _, err := q.ExecContext(ctx, d.d.Bind(`INSERT INTO `+discarded+` (id, event_id, event_type, aggregate_type,
	aggregate_id, aggregate_sequence, idempotency_key, payload, headers, delivery_attempts, last_error,
	failure_kind, occurred_at, created_at, failed_at, discarded_at)
SELECT id, event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence, idempotency_key,
	payload, headers, delivery_attempts, last_error, failure_kind, occurred_at, created_at, updated_at, ?
FROM `+d.t.Records+` WHERE `+in), append([]any{now}, ids...)...); err != nil {
			return nil, fmt.Errorf("keep in %s: %w", discarded, err)
		}
		res, err := q.ExecContext(ctx, d.d.Bind(`DELETE FROM `+d.t.Records+` WHERE `+in), ids...)
		if err != nil {
			return nil, fmt.Errorf("delete: %w", err)
		}
		if n, err := res.RowsAffected(); err == nil && int(n) != len(chunk) {
			// The rows were locked as read; on SQLite nothing commits
			// meanwhile. A difference means a change the lock did not hold.
			return nil, fmt.Errorf("delete: %d of %d selected rows were still failed", n, len(chunk))
		}
	}
	return taken, nil
}

// placeholders returns n ? placeholders separated by commas.
func placeholders(n int) string {
	return strings.TrimSuffix(strings.Repeat("?, ", n), ", ")
}
