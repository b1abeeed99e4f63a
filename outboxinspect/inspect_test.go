package outboxinspect_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxinspect"
)

func eventIDs(msgs []outboxinspect.MessageInfo) []string {
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.EventID
	}
	return ids
}

func sameIDs(t *testing.T, what string, got []outboxinspect.MessageInfo, want ...string) {
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
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		db := setup(t, e)
		for _, ev := range []outbox.Event{
			{ID: "a1", Type: "order.created", AggregateType: "order", AggregateID: "1"},
			{ID: "a2", Type: "order.paid", AggregateType: "order", AggregateID: "1"},
			{ID: "b1", Type: "order.created", AggregateType: "order", AggregateID: "2"},
			{ID: "c1", Type: "user.created", AggregateType: "user", AggregateID: "1"},
		} {
			mustNil(t, outbox.Publish(db, ev))
		}
		mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', created_at = ? WHERE event_id = 'b1'`,
			at(e, time.Now().Add(-time.Hour))).Error)
		d := newDispatcher(t, db, &recorder{})
		ctx := context.Background()
		for _, tc := range []struct {
			name string
			f    outboxinspect.MessageFilter
			want []string
		}{
			{"everything, newest first", outboxinspect.MessageFilter{}, []string{"c1", "b1", "a2", "a1"}},
			{"oldest first, limited", outboxinspect.MessageFilter{Order: outboxinspect.OldestFirst, Limit: 2}, []string{"a1", "a2"}},
			{"by state", outboxinspect.MessageFilter{States: []string{outbox.StateFailed}}, []string{"b1"}},
			{"by event type", outboxinspect.MessageFilter{EventTypes: []string{"order.created"}, Order: outboxinspect.OldestFirst}, []string{"a1", "b1"}},
			{"by aggregate", outboxinspect.MessageFilter{AggregateType: "order", AggregateID: "1"}, []string{"a2", "a1"}},
			{"by aggregate type", outboxinspect.MessageFilter{AggregateType: "user"}, []string{"c1"}},
			{"by event id", outboxinspect.MessageFilter{EventIDs: []string{"a2", "c1"}}, []string{"c1", "a2"}},
			{"written before", outboxinspect.MessageFilter{CreatedBefore: time.Now().Add(-time.Minute)}, []string{"b1"}},
			{"written after", outboxinspect.MessageFilter{CreatedAfter: time.Now().Add(-time.Minute)}, []string{"c1", "a2", "a1"}},
			{"in sequence order", outboxinspect.MessageFilter{Order: outboxinspect.SequenceOrder}, []string{"a1", "a2", "b1", "c1"}},
			{"sequence range", outboxinspect.MessageFilter{AggregateType: "order", AggregateID: "1", SequenceFrom: 2, SequenceTo: 2}, []string{"a2"}},
		} {
			msgs, err := outboxinspect.New(d).Messages(ctx, tc.f)
			mustNil(t, err)
			sameIDs(t, tc.name, msgs, tc.want...)
		}
	})
}

func TestMessagesReturnAtMostTheDefaultLimit(t *testing.T) {
	db := setup(t, outboxtest.SQLite)
	publishN(t, db, "1", outboxinspect.DefaultMessageLimit+1)
	msgs, err := outboxinspect.New(newDispatcher(t, db, &recorder{})).Messages(context.Background(), outboxinspect.MessageFilter{})
	mustNil(t, err)
	if len(msgs) != outboxinspect.DefaultMessageLimit || msgs[0].Sequence != int64(outboxinspect.DefaultMessageLimit+1) {
		t.Fatalf("got %d messages from sequence %d, want the newest %d", len(msgs), msgs[0].Sequence, outboxinspect.DefaultMessageLimit)
	}
}

func TestMessageReadsTheWholeRow(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		db := setup(t, e)
		occurred := time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC)
		mustNil(t, outbox.Publish(db, outbox.Event{ID: "ev-1", Type: "order.created", AggregateType: "order", AggregateID: "7",
			IdempotencyKey: "k-1", Payload: map[string]int{"total": 3}, Headers: map[string]string{"trace": "abc"}, OccurredAt: occurred}))
		fail := errors.New("broker down")
		d := newDispatcher(t, db, &recorder{Next: func(outbox.Batch) error { return fail }})
		dispatch(t, d)
		m, err := outboxinspect.New(d).Message(context.Background(), "ev-1")
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
	db := setup(t, outboxtest.SQLite)
	_, err := outboxinspect.New(newDispatcher(t, db, &recorder{})).Message(context.Background(), "nope")
	if !errors.Is(err, outboxinspect.ErrMessageNotFound) {
		t.Fatalf("got %v, want ErrMessageNotFound", err)
	}
}

func TestRequeueCandidatesAreWhatRequeueMoves(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		db := setup(t, e)
		now := time.Now()
		for i, id := range []string{"f1", "f2", "f3", "p1"} {
			mustNil(t, outbox.Publish(db, outbox.Event{ID: id, Type: "t", AggregateType: "agg", AggregateID: id}))
			if id != "p1" {
				mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', updated_at = ? WHERE event_id = ?`,
					at(e, now.Add(-time.Duration(10-i)*time.Minute)), id).Error)
			}
		}
		d := newDispatcher(t, db, &recorder{})
		ctx := context.Background()
		f := outbox.RequeueFilter{FailedBefore: now.Add(-8 * time.Minute), Limit: 1}
		dry, err := outboxinspect.New(d).RequeueCandidates(ctx, f)
		mustNil(t, err)
		sameIDs(t, "dry run", dry, "f1")
		n, err := d.Requeue(ctx, f)
		mustNil(t, err)
		pending, err := outboxinspect.New(d).Messages(ctx, outboxinspect.MessageFilter{States: []string{outbox.StatePending}, Order: outboxinspect.OldestFirst})
		mustNil(t, err)
		if n != 1 {
			t.Fatalf("requeue moved %d", n)
		}
		sameIDs(t, "pending after requeue", pending, "f1", "p1")
	})
}

func TestActivityCountsDeliveriesAndFailuresPerInterval(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		db := setup(t, e)
		publishN(t, db, "1", 3)
		publishN(t, db, "2", 1)
		now := time.Now()
		mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ? WHERE aggregate_id = '1' AND aggregate_sequence < 3`,
			at(e, now.Add(-90*time.Second))).Error)
		mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ? WHERE aggregate_id = '1' AND aggregate_sequence = 3`,
			at(e, now.Add(-2*time.Hour))).Error)
		mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', updated_at = ? WHERE aggregate_id = '2'`,
			at(e, now.Add(-10*time.Second))).Error)
		got, err := outboxinspect.New(newDispatcher(t, db, &recorder{})).Activity(context.Background(), time.Minute, 3)
		mustNil(t, err)
		want := []outboxinspect.ActivityBucket{{Delivered: 0}, {Delivered: 2}, {Failed: 1}}
		for i := range want {
			if got[i].Delivered != want[i].Delivered || got[i].Failed != want[i].Failed {
				t.Fatalf("buckets %+v, want counts %+v", got, want)
			}
		}
	})
}
