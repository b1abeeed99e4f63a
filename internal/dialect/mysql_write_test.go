package dialect_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// mysqlWriteDB opens a fresh MySQL database with the outbox schema, and
// returns its pool and the default tables.
func mysqlWriteDB(t *testing.T) (*sql.DB, dialect.Tables) {
	t.Helper()
	db, _ := outboxtest.OpenMySQL(t, nil)
	sqlDB, err := db.DB()
	if err != nil {
		t.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatal(err)
	}
	return sqlDB, dialect.MySQL.Tables(outbox.DefaultTable)
}

// writeEvent inserts e in a transaction of its own, which commits when the
// insert returns no error.
func writeEvent(t *testing.T, db *sql.DB, tb dialect.Tables, e dialect.Record) (bool, error) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	ok, err := dialect.MySQL.InsertEvent(ctx, tx, tb, &e, time.Now(), false)
	if err != nil {
		// A connection the error broke has rolled back already.
		if rerr := tx.Rollback(); rerr != nil && !errors.Is(rerr, driver.ErrBadConn) && !errors.Is(rerr, mysql.ErrInvalidConn) {
			t.Fatal(rerr)
		}
		return ok, err
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	return ok, nil
}

func mysqlEvent(id, agg, key string) dialect.Record {
	return dialect.Record{ID: id, Type: "t", AggregateType: "order", AggregateID: agg, Key: key, Payload: `{"n":1}`, OccurredAt: time.Now()}
}

type mysqlRow struct {
	EventID, IdempotencyKey, AggregateID, DeliveryState string
	AggregateSequence                                   int64
}

func mysqlRows(t *testing.T, db *sql.DB, tb dialect.Tables) []mysqlRow {
	t.Helper()
	res, err := db.Query(`SELECT event_id, idempotency_key, aggregate_id, delivery_state, aggregate_sequence FROM ` + tb.Records + ` ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Close()
	var out []mysqlRow
	for res.Next() {
		var r mysqlRow
		if err := res.Scan(&r.EventID, &r.IdempotencyKey, &r.AggregateID, &r.DeliveryState, &r.AggregateSequence); err != nil {
			t.Fatal(err)
		}
		out = append(out, r)
	}
	if err := res.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func lastSequence(t *testing.T, db *sql.DB, tb dialect.Tables, agg string) int64 {
	t.Helper()
	var n int64
	if err := db.QueryRow(`SELECT last_sequence FROM `+tb.Sequences+` WHERE aggregate_type = 'order' AND aggregate_id = ?`, agg).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestMySQLInsertEventNumbersEachAggregateFromOne(t *testing.T) {
	t.Parallel()
	db, tb := mysqlWriteDB(t)
	for i, agg := range []string{"a", "b", "a", "a", "b"} {
		id := string(rune('1' + i))
		if ok, err := writeEvent(t, db, tb, mysqlEvent(id, agg, id)); !ok || err != nil {
			t.Fatalf("event %s: inserted %v, %v", id, ok, err)
		}
	}
	var got []int64
	for _, r := range mysqlRows(t, db, tb) {
		got = append(got, r.AggregateSequence)
	}
	if want := []int64{1, 1, 2, 3, 2}; !equalInts(got, want) {
		t.Fatalf("sequences %v, want %v", got, want)
	}
}

func TestMySQLInsertEventWithAKnownKeyLeavesTheDeliveredRowAndTheSequence(t *testing.T) {
	t.Parallel()
	db, tb := mysqlWriteDB(t)
	if ok, err := writeEvent(t, db, tb, mysqlEvent("e1", "a", "k")); !ok || err != nil {
		t.Fatalf("first: inserted %v, %v", ok, err)
	}
	if _, err := db.Exec(`UPDATE ` + tb.Records + ` SET delivery_state = 'delivered', delivered_at = now(6)`); err != nil {
		t.Fatal(err)
	}
	ok, err := writeEvent(t, db, tb, mysqlEvent("e2", "a", "k"))
	if ok || err != nil {
		t.Fatalf("same key: inserted %v, %v; want false, nil", ok, err)
	}
	rows := mysqlRows(t, db, tb)
	if len(rows) != 1 || rows[0].EventID != "e1" || rows[0].DeliveryState != "delivered" {
		t.Fatalf("rows %+v, want e1 alone, delivered", rows)
	}
	if n := lastSequence(t, db, tb, "a"); n != 1 {
		t.Fatalf("last sequence %d after the duplicate, want 1", n)
	}
}

func TestMySQLInsertEventWithAKnownEventIDUnderAnotherKeyFails(t *testing.T) {
	t.Parallel()
	db, tb := mysqlWriteDB(t)
	if ok, err := writeEvent(t, db, tb, mysqlEvent("e1", "a", "k1")); !ok || err != nil {
		t.Fatalf("first: inserted %v, %v", ok, err)
	}
	// In one transaction that goes on and commits after the error: the
	// sequence is given back, so the next event is number 2.
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	e := mysqlEvent("e1", "a", "k2")
	ok, err := dialect.MySQL.InsertEvent(ctx, tx, tb, &e, time.Now(), false)
	if ok || dialect.DuplicateKey(err) != outbox.DefaultTable+"_event_id_key" {
		t.Fatalf("event id clash: inserted %v, %v; want the event_id key's duplicate error", ok, err)
	}
	next := mysqlEvent("e3", "a", "k3")
	if ok, err := dialect.MySQL.InsertEvent(ctx, tx, tb, &next, time.Now(), false); !ok || err != nil {
		t.Fatalf("after the clash: inserted %v, %v", ok, err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	rows := mysqlRows(t, db, tb)
	if len(rows) != 2 || rows[1].EventID != "e3" || rows[1].AggregateSequence != 2 {
		t.Fatalf("rows %+v, want e1 then e3 with sequence 2", rows)
	}
}

func TestMySQLKeysCompareByteForByte(t *testing.T) {
	t.Parallel()
	db, tb := mysqlWriteDB(t)
	keys := []string{"k", "K", "k ", "k\u00e9", "ke\u0301"}
	for i, k := range keys {
		id := string(rune('a' + i))
		if ok, err := writeEvent(t, db, tb, mysqlEvent(id, k, k)); !ok || err != nil {
			t.Fatalf("key %q: inserted %v, %v; want a row of its own", k, ok, err)
		}
	}
	rows := mysqlRows(t, db, tb)
	if len(rows) != len(keys) {
		t.Fatalf("%d rows, want %d", len(rows), len(keys))
	}
	for i, r := range rows {
		if r.IdempotencyKey != keys[i] || r.AggregateID != keys[i] || r.AggregateSequence != 1 {
			t.Fatalf("row %d: %+v, want key and aggregate %q, sequence 1", i, r, keys[i])
		}
	}
}

func TestMySQLRefusedValuesAreInvalidEventsAndLeaveNoSequence(t *testing.T) {
	t.Parallel()
	db, tb := mysqlWriteDB(t)
	for _, c := range []struct {
		name string
		edit func(e *dialect.Record)
	}{
		{"aggregate id over its width", func(e *dialect.Record) { e.AggregateID = strings.Repeat("x", 1021) }},
		{"idempotency key over its width", func(e *dialect.Record) { e.Key = strings.Repeat("x", 1021) }},
		{"payload not UTF-8", func(e *dialect.Record) { e.Payload = "\"\xff\"" }},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := mysqlEvent("e-"+c.name, "a", "k-"+c.name)
			c.edit(&e)
			ok, err := writeEvent(t, db, tb, e)
			if ok || !dialect.MySQL.RejectsData(err) {
				t.Fatalf("inserted %v, %v; want a refused value", ok, err)
			}
		})
	}
	if n := len(mysqlRows(t, db, tb)); n != 0 {
		t.Fatalf("%d rows, want none", n)
	}
}

func TestMySQLPayloadOverMaxAllowedPacketIsRefusedBeforeItIsSent(t *testing.T) {
	t.Parallel()
	db, tb := mysqlWriteDB(t)
	var packet int64
	if err := db.QueryRow(`SELECT @@max_allowed_packet`).Scan(&packet); err != nil {
		t.Fatal(err)
	}
	e := mysqlEvent("big", "a", "big")
	e.Payload = `"` + strings.Repeat("x", int(packet)) + `"`
	ok, err := writeEvent(t, db, tb, e)
	if ok || !errors.Is(err, dialect.ErrOverPacket) || !dialect.MySQL.RejectsData(err) {
		t.Fatalf("inserted %v, %.200v; want errOverPacket", ok, err)
	}
	if n := len(mysqlRows(t, db, tb)); n != 0 {
		t.Fatalf("%d rows, want none", n)
	}
	if ok, err := writeEvent(t, db, tb, mysqlEvent("small", "a", "small")); !ok || err != nil {
		t.Fatalf("a write after it: inserted %v, %v", ok, err)
	}
	if n := lastSequence(t, db, tb, "a"); n != 1 {
		t.Fatalf("last sequence %d, want 1", n)
	}
}

func equalInts(a, b []int64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
