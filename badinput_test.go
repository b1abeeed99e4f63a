package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// badMarshaler fails to encode itself, or encodes itself as broken JSON.
type badMarshaler struct{ broken bool }

func (m badMarshaler) MarshalJSON() ([]byte, error) {
	if m.broken {
		return []byte(`{"unterminated":`), nil
	}
	return nil, errors.New("cannot encode this value")
}

// badEvents are invalid events and payloads, each with what its error must
// say.
var badEvents = []struct {
	name string
	ev   outbox.Event
	says string
}{
	{"NoType", outbox.Event{AggregateType: "order", AggregateID: "1"}, "Type is empty"},
	{"NoAggregateType", outbox.Event{Type: "order.bad", AggregateID: "1"}, "AggregateType is empty"},
	{"NoAggregateID", outbox.Event{Type: "order.bad", AggregateType: "order"}, "AggregateID is empty"},
	{"ChannelPayload", outbox.Event{Type: "order.bad", AggregateType: "order", AggregateID: "1", Payload: make(chan int)}, "unsupported type"},
	{"FunctionPayload", outbox.Event{Type: "order.bad", AggregateType: "order", AggregateID: "1", Payload: map[string]any{"f": func() {}}}, "unsupported type"},
	{"ComplexPayload", outbox.Event{Type: "order.bad", AggregateType: "order", AggregateID: "1", Payload: complex(1, 2)}, "unsupported type"},
	{"NaNPayload", outbox.Event{Type: "order.bad", AggregateType: "order", AggregateID: "1", Payload: math.NaN()}, "unsupported value"},
	{"InfinityInPayload", outbox.Event{Type: "order.bad", AggregateType: "order", AggregateID: "1", Payload: map[string]float64{"total": math.Inf(1)}}, "unsupported value"},
	{"CyclicPayload", outbox.Event{Type: "order.bad", AggregateType: "order", AggregateID: "1", Payload: func() any { c := &cyclic{}; c.Next = c; return c }()}, "cycle"},
	{"MarshalerFails", outbox.Event{Type: "order.bad", AggregateType: "order", AggregateID: "1", Payload: badMarshaler{}}, "cannot encode this value"},
	{"MarshalerReturnsBrokenJSON", outbox.Event{Type: "order.bad", AggregateType: "order", AggregateID: "1", Payload: badMarshaler{broken: true}}, "MarshalJSON"},
	{"TruncatedRawJSON", outbox.Event{Type: "order.bad", AggregateType: "order", AggregateID: "1", Payload: json.RawMessage(`{"a":`)}, "not valid JSON"},
	{"RawJSONWithTrailingData", outbox.Event{Type: "order.bad", AggregateType: "order", AggregateID: "1", Payload: json.RawMessage(`{} {}`)}, "not valid JSON"},
	{"SingleQuotedRawJSON", outbox.Event{Type: "order.bad", AggregateType: "order", AggregateID: "1", Payload: json.RawMessage(`{'a': 1}`)}, "not valid JSON"},
	{"EmptyRawJSON", outbox.Event{Type: "order.bad", AggregateType: "order", AggregateID: "1", Payload: json.RawMessage{}}, "not valid JSON"},
	{"BytesThatAreNotJSON", outbox.Event{Type: "order.bad", AggregateType: "order", AggregateID: "1", Payload: []byte("total=3")}, "not valid JSON"},
}

// TestBadInputFailsTheWholeTransaction publishes each invalid event, after
// a valid one, inside a transaction that has already written a business
// row (with its own event): Publish fails with an error that wraps
// ErrInvalidEvent and says what is wrong, the transaction fails as a
// whole, and nothing is written. The same holds for Publish outside a
// transaction.
func TestBadInputFailsTheWholeTransaction(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		good := outbox.Event{Type: "order.noted", AggregateType: "order", AggregateID: "1", Payload: map[string]int{"n": 1}}
		for _, c := range badEvents {
			t.Run(c.name, func(t *testing.T) {
				err := b.db.Transaction(func(tx *gorm.DB) error {
					if err := tx.Create(&Order{Status: c.name}).Error; err != nil {
						return err
					}
					return outbox.Publish(tx, good, c.ev)
				})
				checkRejected(t, err, c.ev, c.says)
				err = outbox.Publish(b.db, good, c.ev)
				checkRejected(t, err, c.ev, c.says)
				var orders int64
				mustNil(t, b.db.Model(&Order{}).Count(&orders).Error)
				if n := len(b.records(t)); orders != 0 || n != 0 {
					t.Fatalf("%d business rows and %d outbox rows written, want none", orders, n)
				}
			})
		}
		// The database is still usable, and sequences start at 1: nothing
		// of the failed writes was left behind.
		mustNil(t, outbox.Publish(b.db, good))
		if rs := b.records(t); len(rs) != 1 || rs[0].AggregateSequence != 1 {
			t.Fatalf("after the failures: %d rows, sequence %d; want one row with sequence 1", len(rs), rs[0].AggregateSequence)
		}
	})
}

func checkRejected(t *testing.T, err error, ev outbox.Event, says string) {
	t.Helper()
	if !errors.Is(err, outbox.ErrInvalidEvent) {
		t.Fatalf("err = %v, want one wrapping ErrInvalidEvent", err)
	}
	if !strings.Contains(err.Error(), says) || (ev.Type != "" && !strings.Contains(err.Error(), ev.Type)) {
		t.Fatalf("err = %q, want it to name the event type %q and say %q", err, ev.Type, says)
	}
}

// TestUnstorableEventIsInvalidOnEveryEngine: text that PostgreSQL cannot
// store (NUL characters, invalid UTF-8, unpaired UTF-16 surrogates in JSON
// escapes) passes the library's validation today. SQLite then stores it,
// and PostgreSQL rejects the write with a raw driver error that does not
// wrap ErrInvalidEvent, so the same event is valid in development and fails
// in production with an unclear error. Each must be rejected, on both
// engines, with ErrInvalidEvent and nothing written.
//
// This test fails until the library validates text (see the report of the
// crash and fault suite).
func TestUnstorableEventIsInvalidOnEveryEngine(t *testing.T) {
	cases := []struct {
		name string
		ev   outbox.Event
	}{
		{"NULInPayloadString", outbox.Event{Type: "order.noted", AggregateType: "order", AggregateID: "1", Payload: map[string]string{"note": "a\x00b"}}},
		{"NULEscapeInRawPayload", outbox.Event{Type: "order.noted", AggregateType: "order", AggregateID: "1", Payload: json.RawMessage(`{"note":"a\u0000b"}`)}},
		{"InvalidUTF8InRawPayload", outbox.Event{Type: "order.noted", AggregateType: "order", AggregateID: "1", Payload: json.RawMessage("{\"note\":\"\xff\"}")}},
		{"UnpairedSurrogateInRawPayload", outbox.Event{Type: "order.noted", AggregateType: "order", AggregateID: "1", Payload: json.RawMessage(`{"note":"\ud800"}`)}},
		{"NULInType", outbox.Event{Type: "order.\x00noted", AggregateType: "order", AggregateID: "1"}},
		{"InvalidUTF8InAggregateID", outbox.Event{Type: "order.noted", AggregateType: "order", AggregateID: "1\xff"}},
		{"NULInHeader", outbox.Event{Type: "order.noted", AggregateType: "order", AggregateID: "1", Headers: map[string]string{"trace": "a\x00b"}}},
	}
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				err := outbox.Publish(b.db, c.ev)
				if !errors.Is(err, outbox.ErrInvalidEvent) {
					t.Errorf("Publish: err = %v, want one wrapping ErrInvalidEvent", err)
				}
				if n := len(b.records(t)); n != 0 {
					t.Errorf("%d outbox rows written, want none", n)
					mustNil(t, b.db.Exec(`DELETE FROM outbox_records`).Error)
				}
			})
		}
	})
}

// TestWithTableNameIsRejectedOrWorks: SQLite reserves table names that
// begin with "sqlite_" (in any case); WithTable accepts them today, and
// AutoMigrate then fails with "object name reserved for internal use". A
// name WithTable accepts must work on both engines, so such a name must be
// rejected with ErrInvalidOption (or work).
//
// This test fails until WithTable rejects those names (see the report of
// the crash and fault suite).
func TestWithTableNameIsRejectedOrWorks(t *testing.T) {
	for _, name := range []string{"sqlite_events", "SQLite_Outbox"} {
		t.Run(name, func(t *testing.T) {
			db, _ := outboxtest.Open(t, outboxtest.SQLite, nil)
			err := db.Use(outbox.Plugin(outbox.WithTable(name)))
			if err != nil {
				if !errors.Is(err, outbox.ErrInvalidOption) {
					t.Fatalf("db.Use: %v, want ErrInvalidOption", err)
				}
				return
			}
			if err := outbox.AutoMigrate(db); err != nil {
				t.Fatalf("WithTable(%q) was accepted, but AutoMigrate fails: %v", name, err)
			}
			mustNil(t, outbox.Publish(db, outbox.Event{Type: "t", AggregateType: "a", AggregateID: "1"}))
			if n := outboxtest.Count(t, db, name); n != 1 {
				t.Fatalf("%s holds %d rows, want 1", name, n)
			}
			d := newDispatcher(t, db, &recorder{})
			if n, err := d.DispatchOnce(context.Background()); n != 1 || err != nil {
				t.Fatalf("DispatchOnce = %d, %v; want 1", n, err)
			}
		})
	}
}

// A row that cannot be read into a message (written by hand or by another
// program) is dead-lettered with the reason; the events after it in its
// aggregate wait behind it, and every other event is delivered.
func TestUnreadableRowIsDeadLetteredAndHoldsBackOnlyItsAggregate(t *testing.T) {
	for _, tc := range []struct {
		name    string
		engines []outboxtest.Engine
		spoil   string
	}{
		{"headers that are not a JSON object of strings", []outboxtest.Engine{outboxtest.SQLite, outboxtest.Postgres, outboxtest.MySQL},
			`UPDATE outbox_records SET headers = '{"k": 1}'`},
		// PostgreSQL's timestamptz and MySQL's DATETIME columns cannot hold it.
		{"an occurred_at that is not a time", []outboxtest.Engine{outboxtest.SQLite},
			`UPDATE outbox_records SET occurred_at = 'yesterday'`},
	} {
		for _, e := range tc.engines {
			t.Run(tc.name+", "+string(e), func(t *testing.T) {
				b := setup(t, e, nil)
				publishN(t, b.db, "x", 2)
				mustNil(t, b.db.Exec(tc.spoil+` WHERE aggregate_id = 'x' AND aggregate_sequence = 1`).Error)
				for _, a := range []string{"a", "b", "c", "d", "e"} {
					publishN(t, b.db, a, 1)
				}
				rec := &recorder{}
				d := newDispatcher(t, b.db, rec, outbox.WithBatchSize(3)) // x#1 x#2 a#1 first
				for range 3 {
					dispatch(t, d)
				}
				got := map[string]string{}
				var lastError string
				mustNil(t, b.db.Raw(`SELECT last_error FROM outbox_records WHERE aggregate_id = 'x' AND aggregate_sequence = 1`).Scan(&lastError).Error)
				if !strings.Contains(lastError, "cannot be read") {
					t.Errorf("x#1's last_error %q does not say it cannot be read", lastError)
				}
				var states []struct {
					AggregateID       string
					AggregateSequence int64
					DeliveryState     string
				}
				mustNil(t, b.db.Raw(`SELECT aggregate_id, aggregate_sequence, delivery_state FROM outbox_records`).Scan(&states).Error)
				for _, r := range states {
					got[fmt.Sprintf("%s#%d", r.AggregateID, r.AggregateSequence)] = r.DeliveryState
				}
				want := map[string]string{"x#1": outbox.StateFailed, "x#2": outbox.StatePending,
					"a#1": outbox.StateDelivered, "b#1": outbox.StateDelivered, "c#1": outbox.StateDelivered,
					"d#1": outbox.StateDelivered, "e#1": outbox.StateDelivered}
				if fmt.Sprint(got) != fmt.Sprint(want) {
					t.Fatalf("states %v, want %v", got, want)
				}
				for _, batch := range rec.BatchIDs() {
					for _, id := range batch {
						if strings.HasPrefix(id, "x#") {
							t.Errorf("%s was published", id)
						}
					}
				}
			})
		}
	}
}

// Picky is a column type whose Scan refuses the value "x", which its
// Value writes all the same.
type Picky string

func (p *Picky) Scan(v any) error {
	var s string
	switch v := v.(type) {
	case string:
		s = v
	case []byte:
		s = string(v)
	}
	if s == "x" {
		return errors.New("picky: x is refused")
	}
	*p = Picky(s)
	return nil
}

type PickyRow struct {
	ID uint
	P  Picky
}

func (r *PickyRow) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("picky", op, r.ID, r), nil
}

// TestRowThePluginCannotReadBackLeavesNothingWhenTheCallerCommits: a
// create whose row the plugin cannot read back fails; the caller ignores
// the error and commits. No row remains without its event: the savepoint
// took the row with it (SQLite, MySQL), or the transaction refuses to
// commit (PostgreSQL).
func TestRowThePluginCannotReadBackLeavesNothingWhenTheCallerCommits(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		mustNil(t, b.db.AutoMigrate(&PickyRow{}))
		var writeErr error
		txErr := b.db.Transaction(func(tx *gorm.DB) error {
			if err := tx.Create(&PickyRow{P: "kept"}).Error; err != nil {
				return err
			}
			writeErr = tx.Create(&PickyRow{P: "x"}).Error
			return nil // the caller ignores the error and commits
		})
		if writeErr == nil || !strings.Contains(writeErr.Error(), "x is refused") {
			t.Fatalf("err = %v, want the Scan's", writeErr)
		}
		var n int64
		mustNil(t, b.db.Model(&PickyRow{}).Count(&n).Error)
		want := int64(1)
		if e == outboxtest.Postgres {
			if txErr == nil {
				t.Fatal("PostgreSQL committed the transaction after the failed write")
			}
			want = 0
		} else {
			mustNil(t, txErr)
		}
		if events := int64(len(b.records(t))); n != want || events != want {
			t.Fatalf("%d rows and %d events after the commit, want %d of each", n, events, want)
		}
	})
}
