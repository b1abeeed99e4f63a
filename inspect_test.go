package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// at returns t as the engine's tests store timestamps planted by SQL: the
// fixed-width UTC text on SQLite, a time on PostgreSQL.
func at(e outboxtest.Engine, t time.Time) any {
	if e == outboxtest.SQLite {
		return t.UTC().Format("2006-01-02 15:04:05.000000000+00:00")
	}
	return t
}

func eventIDs(msgs []outbox.MessageInfo) []string {
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.EventID
	}
	return ids
}

func sameIDs(t *testing.T, what string, got []outbox.MessageInfo, want ...string) {
	t.Helper()
	ids := eventIDs(got)
	if len(ids) != len(want) {
		t.Fatalf("%s: got %v, want %v", what, ids, want)
	}
	for i := range ids {
		if ids[i] != want[i] {
			t.Fatalf("%s: got %v, want %v", what, ids, want)
		}
	}
}

func TestMessagesSelectByEveryFilter(t *testing.T) {
	forEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		for _, ev := range []outbox.Event{
			{ID: "a1", Type: "order.created", AggregateType: "order", AggregateID: "1"},
			{ID: "a2", Type: "order.paid", AggregateType: "order", AggregateID: "1"},
			{ID: "b1", Type: "order.created", AggregateType: "order", AggregateID: "2"},
			{ID: "c1", Type: "user.created", AggregateType: "user", AggregateID: "1"},
		} {
			mustNil(t, outbox.Publish(b.db, ev))
		}
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', created_at = ? WHERE event_id = 'b1'`,
			at(e, time.Now().Add(-time.Hour))).Error)
		d := newDispatcher(t, b.db, &recorder{})
		ctx := context.Background()
		for _, tc := range []struct {
			name string
			f    outbox.MessageFilter
			want []string
		}{
			{"everything, newest first", outbox.MessageFilter{}, []string{"c1", "b1", "a2", "a1"}},
			{"oldest first, limited", outbox.MessageFilter{Order: outbox.OldestFirst, Limit: 2}, []string{"a1", "a2"}},
			{"by state", outbox.MessageFilter{States: []string{outbox.StateFailed}}, []string{"b1"}},
			{"by event type", outbox.MessageFilter{EventTypes: []string{"order.created"}, Order: outbox.OldestFirst}, []string{"a1", "b1"}},
			{"by aggregate", outbox.MessageFilter{AggregateType: "order", AggregateID: "1"}, []string{"a2", "a1"}},
			{"by aggregate type", outbox.MessageFilter{AggregateType: "user"}, []string{"c1"}},
			{"by event id", outbox.MessageFilter{EventIDs: []string{"a2", "c1"}}, []string{"c1", "a2"}},
			{"written before", outbox.MessageFilter{CreatedBefore: time.Now().Add(-time.Minute)}, []string{"b1"}},
			{"written after", outbox.MessageFilter{CreatedAfter: time.Now().Add(-time.Minute)}, []string{"c1", "a2", "a1"}},
			{"in sequence order", outbox.MessageFilter{Order: outbox.SequenceOrder}, []string{"a1", "a2", "b1", "c1"}},
			{"sequence range", outbox.MessageFilter{AggregateType: "order", AggregateID: "1", SequenceFrom: 2, SequenceTo: 2}, []string{"a2"}},
		} {
			msgs, err := d.Messages(ctx, tc.f)
			mustNil(t, err)
			sameIDs(t, tc.name, msgs, tc.want...)
		}
	})
}

func TestMessagesReturnAtMostTheDefaultLimit(t *testing.T) {
	b := setup(t, outboxtest.SQLite, nil)
	publishN(t, b.db, "1", outbox.DefaultMessageLimit+1)
	msgs, err := newDispatcher(t, b.db, &recorder{}).Messages(context.Background(), outbox.MessageFilter{})
	mustNil(t, err)
	if len(msgs) != outbox.DefaultMessageLimit || msgs[0].Sequence != int64(outbox.DefaultMessageLimit+1) {
		t.Fatalf("got %d messages from sequence %d, want the newest %d", len(msgs), msgs[0].Sequence, outbox.DefaultMessageLimit)
	}
}

func TestMessageReadsTheWholeRow(t *testing.T) {
	forEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		occurred := time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC)
		mustNil(t, outbox.Publish(b.db, outbox.Event{ID: "ev-1", Type: "order.created", AggregateType: "order", AggregateID: "7",
			IdempotencyKey: "k-1", Payload: map[string]int{"total": 3}, Headers: map[string]string{"trace": "abc"}, OccurredAt: occurred}))
		fail := errors.New("broker down")
		d := newDispatcher(t, b.db, &recorder{Next: func(outbox.Batch) error { return fail }})
		dispatch(t, d)
		m, err := d.Message(context.Background(), "ev-1")
		mustNil(t, err)
		var payload map[string]int
		mustNil(t, json.Unmarshal(m.Payload, &payload))
		if m.EventType != "order.created" || m.AggregateType != "order" || m.AggregateID != "7" || m.Sequence != 1 ||
			m.IdempotencyKey != "k-1" || payload["total"] != 3 || m.Headers["trace"] != "abc" ||
			m.State != outbox.StateRetry || m.Attempts != 1 || m.LastError == "" || !m.OccurredAt.Equal(occurred) ||
			m.CreatedAt.IsZero() || m.UpdatedAt.IsZero() || m.NextAttemptAt.IsZero() || !m.DeliveredAt.IsZero() || !m.LockedUntil.IsZero() {
			t.Fatalf("read %+v", m)
		}
	})
}

func TestMessageOfAnUnknownEventIsNotFound(t *testing.T) {
	b := setup(t, outboxtest.SQLite, nil)
	_, err := newDispatcher(t, b.db, &recorder{}).Message(context.Background(), "nope")
	if !errors.Is(err, outbox.ErrMessageNotFound) {
		t.Fatalf("got %v, want ErrMessageNotFound", err)
	}
}

func TestRequeueCandidatesAreWhatRequeueMoves(t *testing.T) {
	forEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		now := time.Now()
		for i, id := range []string{"f1", "f2", "f3", "p1"} {
			mustNil(t, outbox.Publish(b.db, outbox.Event{ID: id, Type: "t", AggregateType: "agg", AggregateID: id}))
			if id != "p1" {
				mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', updated_at = ? WHERE event_id = ?`,
					at(e, now.Add(-time.Duration(10-i)*time.Minute)), id).Error)
			}
		}
		d := newDispatcher(t, b.db, &recorder{})
		ctx := context.Background()
		f := outbox.RequeueFilter{FailedBefore: now.Add(-8 * time.Minute), Limit: 1}
		dry, err := d.RequeueCandidates(ctx, f)
		mustNil(t, err)
		sameIDs(t, "dry run", dry, "f1")
		n, err := d.Requeue(ctx, f)
		mustNil(t, err)
		pending, err := d.Messages(ctx, outbox.MessageFilter{States: []string{outbox.StatePending}, Order: outbox.OldestFirst})
		mustNil(t, err)
		if n != 1 {
			t.Fatalf("requeue moved %d", n)
		}
		sameIDs(t, "pending after requeue", pending, "f1", "p1")
	})
}

func TestActivityCountsDeliveriesAndFailuresPerInterval(t *testing.T) {
	forEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "1", 3)
		publishN(t, b.db, "2", 1)
		now := time.Now()
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ? WHERE aggregate_id = '1' AND aggregate_sequence < 3`,
			at(e, now.Add(-90*time.Second))).Error)
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ? WHERE aggregate_id = '1' AND aggregate_sequence = 3`,
			at(e, now.Add(-2*time.Hour))).Error)
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', updated_at = ? WHERE aggregate_id = '2'`,
			at(e, now.Add(-10*time.Second))).Error)
		got, err := newDispatcher(t, b.db, &recorder{}).Activity(context.Background(), time.Minute, 3)
		mustNil(t, err)
		want := []outbox.ActivityBucket{{Delivered: 0}, {Delivered: 2}, {Failed: 1}}
		for i := range want {
			if got[i].Delivered != want[i].Delivered || got[i].Failed != want[i].Failed {
				t.Fatalf("buckets %+v, want counts %+v", got, want)
			}
		}
	})
}

// What an operator looks at first: the dead letters of one event type,
// and then one of them whole.
func ExampleDispatcher_Messages() {
	db, done := openExampleDB()
	defer done()
	for _, id := range []string{"evt-1", "evt-2"} {
		outbox.Publish(db, outbox.Event{ID: id, Type: "order.created", AggregateType: "order", AggregateID: "42",
			Payload: map[string]int{"total": 3}})
	}
	db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', delivery_attempts = 10, last_error = 'broker said no' WHERE event_id = 'evt-1'`)
	d, _ := outbox.NewDispatcher(db, outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil }))

	dead, _ := d.Messages(context.Background(), outbox.MessageFilter{States: []string{outbox.StateFailed}, EventTypes: []string{"order.created"}})
	for _, m := range dead {
		fmt.Println(m.EventID, m.AggregateType+"/"+m.AggregateID, m.Sequence, m.Attempts, m.LastError)
	}
	m, _ := d.Message(context.Background(), "evt-2")
	fmt.Println(m.EventID, m.State, string(m.Payload))
	_, err := d.Message(context.Background(), "evt-3")
	fmt.Println(errors.Is(err, outbox.ErrMessageNotFound))
	// Output:
	// evt-1 order/42 1 10 broker said no
	// evt-2 pending {"total":3}
	// true
}
