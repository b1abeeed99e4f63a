package outbox_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// payloadOf returns a JSON string of exactly n bytes, quotes included.
func payloadOf(n int) json.RawMessage {
	return json.RawMessage(`"` + strings.Repeat("x", n-2) + `"`)
}

// checkTooLarge asserts that err refuses an event of type typ for its
// payload of size bytes over limit.
func checkTooLarge(t *testing.T, err error, typ string, size, limit int) {
	t.Helper()
	if !errors.Is(err, outbox.ErrInvalidEvent) {
		t.Fatalf("err = %v, want one wrapping ErrInvalidEvent", err)
	}
	for _, says := range []string{typ, fmt.Sprint(size), fmt.Sprint(limit)} {
		if !strings.Contains(err.Error(), says) {
			t.Fatalf("err = %q, want it to name %q (the type, the size and the limit)", err, says)
		}
	}
}

func TestPayloadOverTheDefaultMiBIsInvalidOnEveryEngine(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		at := outbox.Event{Type: "blob.put", AggregateType: "blob", AggregateID: "1", Payload: payloadOf(outbox.DefaultMaxPayloadBytes)}
		over := at
		over.Payload = payloadOf(outbox.DefaultMaxPayloadBytes + 1)
		checkTooLarge(t, outbox.Publish(b.db, over), "blob.put", outbox.DefaultMaxPayloadBytes+1, outbox.DefaultMaxPayloadBytes)
		if n := len(b.records(t)); n != 0 {
			t.Fatalf("%d outbox rows after the refused event, want none", n)
		}
		mustNil(t, outbox.Publish(b.db, at))
		if rs := b.records(t); len(rs) != 1 || rs[0].AggregateSequence != 1 {
			t.Fatalf("after a payload of exactly the limit: %d rows, want one with sequence 1", len(rs))
		}
	})
}

func TestPayloadOverWithMaxPayloadBytesFailsTheWholeWrite(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		const limit = 100
		b := setup(t, e, nil, outbox.WithMaxPayloadBytes(limit))
		big := strings.Repeat("y", limit)
		t.Run("a model's event", func(t *testing.T) {
			err := b.db.Create(&Order{Status: big}).Error
			o := Order{Status: big}
			body, _ := json.Marshal(&o)
			checkTooLarge(t, err, "order.create", len(body), limit)
		})
		t.Run("Publish in the business write's transaction", func(t *testing.T) {
			err := b.db.Transaction(func(tx *gorm.DB) error {
				if err := tx.Create(&Order{Status: "small"}).Error; err != nil {
					return err
				}
				return outbox.Publish(tx, outbox.Event{Type: "order.noted", AggregateType: "order", AggregateID: "1", Payload: payloadOf(limit + 1)})
			})
			checkTooLarge(t, err, "order.noted", limit+1, limit)
		})
		var orders int64
		mustNil(t, b.db.Model(&Order{}).Count(&orders).Error)
		if n := len(b.records(t)); orders != 0 || n != 0 {
			t.Fatalf("%d business rows and %d outbox rows written, want none", orders, n)
		}
		mustNil(t, b.db.Create(&Order{Status: "small"}).Error)
		if n := len(b.records(t)); n != 1 {
			t.Fatalf("%d outbox rows after a small write, want 1", n)
		}
	})
}

func TestWithMaxPayloadBytesMustBePositive(t *testing.T) {
	for _, n := range []int{0, -1} {
		db, _ := outboxtest.Open(t, outboxtest.SQLite, nil)
		err := db.Use(outbox.Plugin(outbox.WithMaxPayloadBytes(n)))
		if !errors.Is(err, outbox.ErrInvalidOption) || !strings.Contains(err.Error(), "WithMaxPayloadBytes") {
			t.Fatalf("WithMaxPayloadBytes(%d): db.Use = %v, want ErrInvalidOption naming the option", n, err)
		}
	}
}
