package outbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// lockedBuffer is a log sink that goroutines may share.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// discardedRow is a row of the discarded table as a test reads it.
type discardedRow struct {
	EventID           string
	AggregateID       string
	AggregateSequence int64
	LastError         string
	FailureKind       string
	DeliveryAttempts  int
	Payload           string
}

func discardedRows(t *testing.T, b bundle) []discardedRow {
	t.Helper()
	var rows []discardedRow
	mustNil(t, b.db.Raw(`SELECT event_id, aggregate_id, aggregate_sequence, coalesce(last_error, '') AS last_error,
		coalesce(failure_kind, '') AS failure_kind, delivery_attempts, payload
		FROM outbox_records_discarded ORDER BY id`).Scan(&rows).Error)
	return rows
}

// poisonFirst fails the first event of the aggregate "poison" for good
// while poisoned, and leaves the later ones of that aggregate in its batch
// unattempted.
func poisonFirst(poisoned *bool) *recorder {
	return &recorder{Next: func(batch outbox.Batch) error {
		failed := map[string]error{}
		for _, m := range batch.Messages {
			switch {
			case m.AggregateID == "poison" && m.Sequence == 1 && *poisoned:
				failed[m.EventID] = outbox.Permanent(errors.New("poison"))
			case m.AggregateID == "poison" && len(failed) > 0:
				failed[m.EventID] = outbox.ErrNotAttempted
			}
		}
		if len(failed) == 0 {
			return nil
		}
		return &outbox.PartialError{Failed: failed}
	}}
}

func TestDiscardedDeadLetterReleasesTheLaterEventsOfItsAggregate(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "poison", 3)
		publishN(t, b.db, "ok", 1)
		poisoned := true
		rec := poisonFirst(&poisoned)
		logs := &lockedBuffer{}
		d := newDispatcher(t, b.db, rec, outbox.WithLease(time.Hour),
			outbox.WithLogger(slog.New(slog.NewTextHandler(logs, nil))))
		dispatch(t, d)
		dispatch(t, d)
		if s := fmt.Sprint(states(t, b)); s != "[failed pending pending delivered]" {
			t.Fatalf("states %s, want the dead letter holding back its aggregate", s)
		}
		var dead string
		mustNil(t, b.db.Raw(`SELECT event_id FROM outbox_records WHERE delivery_state = 'failed'`).Scan(&dead).Error)

		ctx := context.Background()
		n, err := d.Discard(ctx, outbox.RequeueFilter{EventIDs: []string{dead}})
		if n != 1 || err != nil {
			t.Fatalf("Discard = %d, %v; want 1", n, err)
		}
		// The later events go next, in order, at once: they were parked
		// behind the dead letter for the hour's lease.
		dispatch(t, d)
		if got := fmt.Sprint(rec.AcceptedIDs()); got != "[agg/ok#1 agg/poison#2 agg/poison#3]" {
			t.Fatalf("accepted %s, want the poison aggregate's later events in order, never the discarded one", got)
		}
		if s := fmt.Sprint(states(t, b)); s != "[delivered delivered delivered]" {
			t.Fatalf("states %s, want the discarded row gone and the others delivered", s)
		}
		kept := discardedRows(t, b)
		if len(kept) != 1 || kept[0].EventID != dead || kept[0].AggregateSequence != 1 ||
			!contains(kept[0].LastError, "poison") || kept[0].FailureKind != "permanent" ||
			kept[0].DeliveryAttempts != 1 || !contains(kept[0].Payload, "poison") {
			t.Fatalf("discarded table %+v, want the dead letter whole", kept)
		}
		if !contains(logs.String(), dead) {
			t.Fatalf("log %q does not name the discarded event %s", logs.String(), dead)
		}
		// Never requeued, never revived, never delivered.
		if n, err := d.Requeue(ctx, outbox.RequeueFilter{}); n != 0 || err != nil {
			t.Fatalf("Requeue after Discard = %d, %v; want 0", n, err)
		}
		if n, err := d.RetryFailed(ctx); n != 0 || err != nil {
			t.Fatalf("RetryFailed after Discard = %d, %v; want 0", n, err)
		}
		poisoned = false
		dispatch(t, d)
		if got := len(rec.AcceptedIDs()); got != 3 {
			t.Fatalf("%d events accepted after the discard, want 3", got)
		}
	})
}

func TestDiscardTouchesOnlyFailedEvents(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		for _, agg := range []string{"pending", "retry", "delivering", "delivered"} {
			publishN(t, b.db, agg, 1)
			mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = ? WHERE aggregate_id = ?`, agg, agg).Error)
		}
		var ids []string
		mustNil(t, b.db.Raw(`SELECT event_id FROM outbox_records`).Scan(&ids).Error)
		d := newDispatcher(t, b.db, &recorder{})
		for _, f := range []outbox.RequeueFilter{{}, {EventIDs: ids}, {EventTypes: []string{"t"}}} {
			if n, err := d.Discard(context.Background(), f); n != 0 || err != nil {
				t.Fatalf("Discard(%+v) = %d, %v; want 0", f, n, err)
			}
		}
		if s := fmt.Sprint(states(t, b)); s != "[pending retry delivering delivered]" {
			t.Fatalf("states %s, want every row as it was", s)
		}
		if kept := discardedRows(t, b); len(kept) != 0 {
			t.Fatalf("discarded table %+v, want it empty", kept)
		}
	})
}

func TestDiscardFiltersAndBounds(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		for i, typ := range []string{"x", "x", "y", "x", "x"} {
			mustNil(t, outbox.Publish(b.db, outbox.Event{Type: typ, AggregateType: "agg", AggregateID: fmt.Sprint(i)}))
		}
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', delivery_attempts = 10`).Error)
		d := newDispatcher(t, b.db, &recorder{})
		ctx := context.Background()
		if n, err := d.Discard(ctx, outbox.RequeueFilter{EventTypes: []string{"y"}}); n != 1 || err != nil {
			t.Fatalf("by type: %d, %v; want 1", n, err)
		}
		if n, err := d.Discard(ctx, outbox.RequeueFilter{FailedBefore: time.Now().Add(-time.Hour)}); n != 0 || err != nil {
			t.Fatalf("by age: %d, %v; want 0 (all failed just now)", n, err)
		}
		if n, err := d.Discard(ctx, outbox.RequeueFilter{Limit: 2}); n != 2 || err != nil {
			t.Fatalf("bounded: %d, %v; want 2", n, err)
		}
		var left []string
		mustNil(t, b.db.Raw(`SELECT event_id FROM outbox_records ORDER BY id`).Scan(&left).Error)
		if len(left) != 2 {
			t.Fatalf("%d rows left, want 2", len(left))
		}
		if n, err := d.Discard(ctx, outbox.RequeueFilter{EventIDs: []string{"no-such-event", left[1]}}); n != 1 || err != nil {
			t.Fatalf("by id: %d, %v; want 1", n, err)
		}
		var last string
		mustNil(t, b.db.Raw(`SELECT event_id FROM outbox_records`).Scan(&last).Error)
		if last != left[0] {
			t.Fatalf("row left %s, want %s", last, left[0])
		}
		if kept := discardedRows(t, b); len(kept) != 4 {
			t.Fatalf("%d rows in the discarded table, want 4", len(kept))
		}
	})
}

func TestDiscardMovesMoreRowsThanOneStatementHolds(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		events := make([]outbox.Event, 1200)
		for i := range events {
			events[i] = outbox.Event{Type: "t", AggregateType: "agg", AggregateID: fmt.Sprint(i % 7), Payload: map[string]int{"i": i}}
		}
		mustNil(t, outbox.Publish(b.db, events...))
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'failed'`).Error)
		d := newDispatcher(t, b.db, &recorder{}, outbox.WithLogger(slog.New(slog.DiscardHandler)))
		if n, err := d.Discard(context.Background(), outbox.RequeueFilter{Limit: 1100}); n != 1100 || err != nil {
			t.Fatalf("Discard = %d, %v; want 1100", n, err)
		}
		var left, kept int64
		mustNil(t, b.db.Raw(`SELECT count(*) FROM outbox_records`).Scan(&left).Error)
		mustNil(t, b.db.Raw(`SELECT count(*) FROM outbox_records_discarded`).Scan(&kept).Error)
		if left != 100 || kept != 1100 {
			t.Fatalf("%d rows left and %d discarded, want 100 and 1100", left, kept)
		}
	})
}

func TestDiscardWorksOnATableOfTheLongestName(t *testing.T) {
	name := strings.Repeat("t", 43)
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil, outbox.WithTable(name))
		publishN(t, b.db, "a", 2)
		mustNil(t, b.db.Exec(`UPDATE `+name+` SET delivery_state = 'failed' WHERE aggregate_sequence = 1`).Error)
		rec := &recorder{}
		d := newDispatcher(t, b.db, rec)
		if n, err := d.Discard(context.Background(), outbox.RequeueFilter{}); n != 1 || err != nil {
			t.Fatalf("Discard = %d, %v; want 1", n, err)
		}
		dispatch(t, d)
		if got := fmt.Sprint(rec.AcceptedIDs()); got != "[agg/a#2]" {
			t.Fatalf("accepted %s, want the event after the discarded one", got)
		}
		var kept int64
		mustNil(t, b.db.Raw(`SELECT count(*) FROM `+name+outbox.DiscardedTableSuffix).Scan(&kept).Error)
		if kept != 1 {
			t.Fatalf("%d rows in %s_discarded, want 1", kept, name)
		}
	})
}
