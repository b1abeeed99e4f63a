package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"testing"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

type tenantKey struct{}

// tenantHeaders is a WithContextHeaders function: the tenant of ctx, if any.
func tenantHeaders(ctx context.Context) map[string]string {
	tenant, ok := ctx.Value(tenantKey{}).(string)
	if !ok {
		return nil
	}
	return map[string]string{"tenant": tenant, "source": "context"}
}

func withTenant(tenant string) context.Context {
	return context.WithValue(context.Background(), tenantKey{}, tenant)
}

// storedHeaders decodes the headers column of every outbox row, nil for NULL.
func storedHeaders(t *testing.T, b bundle) []map[string]string {
	t.Helper()
	var out []map[string]string
	for _, r := range b.records(t) {
		var h map[string]string
		if r.Headers.Valid {
			if err := json.Unmarshal([]byte(r.Headers.String), &h); err != nil {
				t.Fatalf("headers of %s: %v", r.EventID, err)
			}
		}
		out = append(out, h)
	}
	return out
}

func TestContextHeadersAreStoredWithEveryWayOfWriting(t *testing.T) {
	writes := []struct {
		name  string
		write func(db *gorm.DB) error
	}{
		{"model create", func(db *gorm.DB) error { return db.Create(&Order{Status: "new"}).Error }},
		{"model create in a transaction", func(db *gorm.DB) error {
			return db.Transaction(func(tx *gorm.DB) error { return tx.Create(&Order{Status: "new"}).Error })
		}},
		{"outbox.Transaction", func(db *gorm.DB) error {
			return outbox.Transaction(db, func(tx *gorm.DB) error { return tx.Create(&Order{Status: "new"}).Error })
		}},
		{"Publish outside a transaction", func(db *gorm.DB) error {
			return outbox.Publish(db, outbox.Event{Type: "t", AggregateType: "a", AggregateID: "1"})
		}},
		{"Publish in a transaction", func(db *gorm.DB) error {
			return db.Transaction(func(tx *gorm.DB) error {
				return outbox.Publish(tx, outbox.Event{Type: "t", AggregateType: "a", AggregateID: "1"})
			})
		}},
	}
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		for _, w := range writes {
			t.Run(w.name, func(t *testing.T) {
				b := setup(t, e, nil, outbox.WithContextHeaders(tenantHeaders))
				mustNil(t, w.write(b.db.WithContext(withTenant("acme"))))
				got := storedHeaders(t, b)
				want := map[string]string{"tenant": "acme", "source": "context"}
				if len(got) != 1 || !maps.Equal(got[0], want) {
					t.Fatalf("stored headers %v, want one event with %v", got, want)
				}
			})
		}
	})
}

func TestEventHeadersWinOverContextHeaders(t *testing.T) {
	b := setup(t, outboxtest.SQLite, nil, outbox.WithContextHeaders(tenantHeaders))
	own := map[string]string{"source": "event", "kind": "manual"}
	mustNil(t, outbox.Publish(b.db.WithContext(withTenant("acme")),
		outbox.Event{Type: "t", AggregateType: "a", AggregateID: "1", Headers: own}))
	got := storedHeaders(t, b)
	want := map[string]string{"tenant": "acme", "source": "event", "kind": "manual"}
	if len(got) != 1 || !maps.Equal(got[0], want) {
		t.Fatalf("stored headers %v, want %v", got, want)
	}
	if !maps.Equal(own, map[string]string{"source": "event", "kind": "manual"}) {
		t.Fatalf("the caller's Headers map was modified: %v", own)
	}
}

func TestLaterContextHeadersFunctionWinsAName(t *testing.T) {
	b := setup(t, outboxtest.SQLite, nil,
		outbox.WithContextHeaders(tenantHeaders),
		outbox.WithContextHeaders(func(context.Context) map[string]string {
			return map[string]string{"source": "second"}
		}))
	mustNil(t, b.db.WithContext(withTenant("acme")).Create(&Order{}).Error)
	got := storedHeaders(t, b)
	want := map[string]string{"tenant": "acme", "source": "second"}
	if len(got) != 1 || !maps.Equal(got[0], want) {
		t.Fatalf("stored headers %v, want %v", got, want)
	}
}

func TestContextWithoutHeadersLeavesEventHeadersAsGiven(t *testing.T) {
	b := setup(t, outboxtest.SQLite, nil, outbox.WithContextHeaders(tenantHeaders))
	mustNil(t, b.db.Create(&Order{}).Error) // no tenant in the context
	mustNil(t, outbox.Publish(b.db, outbox.Event{Type: "t", AggregateType: "a", AggregateID: "1", Headers: map[string]string{"k": "v"}}))
	got := storedHeaders(t, b)
	if len(got) != 2 || got[0] != nil || !maps.Equal(got[1], map[string]string{"k": "v"}) {
		t.Fatalf("stored headers %v, want [nil map[k:v]]", got)
	}
}

func TestInvalidContextHeaderFailsTheWrite(t *testing.T) {
	b := setup(t, outboxtest.SQLite, nil, outbox.WithContextHeaders(func(context.Context) map[string]string {
		return map[string]string{"bad": "nul\x00inside"}
	}))
	err := b.db.Create(&Order{Status: "x"}).Error
	if !errors.Is(err, outbox.ErrInvalidEvent) {
		t.Fatalf("Create: %v, want ErrInvalidEvent", err)
	}
	var orders int64
	mustNil(t, b.db.Model(&Order{}).Count(&orders).Error)
	if n := len(b.records(t)); n != 0 || orders != 0 {
		t.Fatalf("%d outbox rows and %d orders written, want none", n, orders)
	}
}

func TestWithContextHeadersRejectsNilFunction(t *testing.T) {
	db, _ := outboxtest.Open(t, outboxtest.SQLite, nil)
	err := db.Use(outbox.Plugin(outbox.WithContextHeaders(nil)))
	if !errors.Is(err, outbox.ErrInvalidOption) {
		t.Fatalf("db.Use: %v, want ErrInvalidOption", err)
	}
}
