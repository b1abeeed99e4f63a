package outbox

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox/internal/outboxtest"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// FuzzEventEncode feeds arbitrary events to the validation and encoding
// every write goes through (Event.encode). It must never panic; a rejection
// must wrap ErrInvalidEvent and have a reason; an accepted event must carry
// its defaults, a payload that is valid JSON (a raw payload stored as is),
// and only text that both engines can store: valid UTF-8, no NUL character
// and no unpaired UTF-16 surrogate in JSON escapes.
//
// mode picks the payload's form: 0 json.RawMessage, 1 []byte, 2 a string,
// 3 a map holding the string, 4 nil, 5 the payload decoded into an any;
// mode&8 adds the header hk: hv.
func FuzzEventEncode(f *testing.F) {
	f.Add("order.created", "order", "42", "", "", []byte(`{"id":42,"status":"new"}`), uint8(0), "", "")
	f.Add("order.created", "order", "42", "evt-1", "key-1", []byte(`[1,2.5,true,null,"x"]`), uint8(1), "", "")
	f.Add("order.created", "order", "42", "", "", []byte(`{"a":`), uint8(0), "", "")
	f.Add("order.created", "order", "42", "", "", []byte(``), uint8(1), "", "")
	f.Add("order.created", "order", "42", "", "", []byte(`{} {}`), uint8(0), "", "")
	f.Add("order.created", "order", "42", "", "", []byte(`"caf\u00e9 \ud83d\ude00"`), uint8(0), "", "")
	f.Add("order.created", "order", "42", "", "", []byte(`1e400`), uint8(0), "", "")
	f.Add("order.created", "order", "42", "", "", []byte("plain text, é"), uint8(2), "", "")
	f.Add("order.created", "order", "42", "", "", []byte("in a map"), uint8(3), "", "")
	f.Add("order.created", "order", "42", "", "", []byte(nil), uint8(4), "", "")
	f.Add("order.created", "order", "42", "", "", []byte(`{"nested":{"list":[{"k":"v"}]}}`), uint8(5), "", "")
	f.Add("order.created", "order", "42", "", "", []byte(`{"id":1}`), uint8(8), "trace", "abc")
	f.Add("order.created", "order", "42", "", "", []byte(`{"id":1}`), uint8(8+3), "", "")
	f.Add("", "order", "42", "", "", []byte(`{}`), uint8(0), "", "")
	f.Add("order.created", "", "42", "", "", []byte(`{}`), uint8(0), "", "")
	f.Add("order.created", "order", "", "", "", []byte(`{}`), uint8(0), "", "")
	f.Add("ordre.créé", "commande", "ñ-42", "", "", []byte(`{"é":"ü"}`), uint8(0), "clé", "valeur")
	f.Fuzz(func(t *testing.T, typ, aggType, aggID, id, key string, payload []byte, mode uint8, hk, hv string) {
		ev := Event{ID: id, Type: typ, AggregateType: aggType, AggregateID: aggID, IdempotencyKey: key}
		raw := false
		switch mode % 8 % 6 {
		case 0:
			ev.Payload, raw = json.RawMessage(payload), true
		case 1:
			ev.Payload, raw = payload, true
		case 2:
			ev.Payload = string(payload)
		case 3:
			ev.Payload = map[string]any{"text": string(payload), "len": len(payload)}
		case 4:
		case 5:
			var v any
			if json.Unmarshal(payload, &v) == nil {
				ev.Payload = v
			} else {
				ev.Payload = string(payload)
			}
		}
		if mode&8 != 0 {
			ev.Headers = map[string]string{hk: hv}
		}
		now := time.Date(2025, 1, 2, 3, 4, 5, 6, time.UTC)
		enc, err := ev.encode(now)

		required := typ != "" && aggType != "" && aggID != ""
		if err != nil {
			if !errors.Is(err, ErrInvalidEvent) {
				t.Fatalf("rejected with %v, which does not wrap ErrInvalidEvent", err)
			}
			// Inputs that are plainly fine must not be rejected.
			fine := required && (!raw || json.Valid(payload)) && plainText(payload) && len(payload) < 1000 && finiteNumbers(payload)
			for _, s := range []string{typ, aggType, aggID, id, key, hk, hv} {
				fine = fine && plainText([]byte(s))
			}
			if fine {
				t.Fatalf("a valid event was rejected: %v", err)
			}
			return
		}
		if !required {
			t.Fatalf("accepted an event without Type, AggregateType or AggregateID: %+v", ev)
		}
		if raw && !json.Valid(payload) {
			t.Fatalf("accepted a raw payload that is not JSON: %q", payload)
		}
		if raw && enc.Payload != string(payload) {
			t.Fatalf("raw payload stored as %q, want it as is: %q", enc.Payload, payload)
		}
		if !json.Valid([]byte(enc.Payload)) {
			t.Fatalf("encoded payload is not JSON: %q", enc.Payload)
		}
		if enc.Headers != nil && !json.Valid([]byte(*enc.Headers)) {
			t.Fatalf("encoded headers are not JSON: %q", *enc.Headers)
		}
		if (ev.Headers == nil) != (enc.Headers == nil) {
			t.Fatalf("headers %v encoded as %v", ev.Headers, enc.Headers)
		}
		switch {
		case id != "" && enc.ID != id, id == "" && enc.ID == "":
			t.Fatalf("event ID %q encoded as %q", id, enc.ID)
		case key != "" && enc.Key != key, key == "" && enc.Key != enc.ID:
			t.Fatalf("idempotency key %q encoded as %q (ID %q)", key, enc.Key, enc.ID)
		case !enc.OccurredAt.Equal(now):
			t.Fatalf("occurred_at %v, want the time of the write %v", enc.OccurredAt, now)
		}
		// What is accepted must be storable on both engines: PostgreSQL
		// rejects NUL characters and invalid UTF-8 in text, and \u0000 and
		// unpaired surrogates in jsonb.
		for name, s := range map[string]string{"Type": enc.Type, "AggregateType": enc.AggregateType, "AggregateID": enc.AggregateID, "ID": enc.ID, "IdempotencyKey": enc.Key} {
			if !utf8.ValidString(s) || strings.ContainsRune(s, 0) {
				t.Fatalf("accepted %s %q, which PostgreSQL cannot store (invalid UTF-8 or NUL)", name, s)
			}
		}
		if why := unstorableJSON(enc.Payload); why != "" {
			t.Fatalf("accepted payload %q, which PostgreSQL cannot store: %s", enc.Payload, why)
		}
		if enc.Headers != nil {
			if why := unstorableJSON(*enc.Headers); why != "" {
				t.Fatalf("accepted headers %q, which PostgreSQL cannot store: %s", *enc.Headers, why)
			}
		}
	})
}

// plainText reports whether b is valid UTF-8 without NUL bytes and without
// JSON \u escapes: text no engine can object to.
func plainText(b []byte) bool {
	return utf8.Valid(b) && bytes.IndexByte(b, 0) < 0 && !bytes.Contains(b, []byte(`\u`))
}

// finiteNumbers reports whether every number in b, if b is JSON, fits a
// float64.
func finiteNumbers(b []byte) bool {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	for {
		tok, err := dec.Token()
		if err != nil {
			return true
		}
		if n, ok := tok.(json.Number); ok {
			if _, err := strconv.ParseFloat(string(n), 64); err != nil {
				return false
			}
		}
	}
}

// unstorableJSON returns why PostgreSQL's jsonb would refuse the valid
// JSON text s, or "" if it would not: invalid UTF-8, the escape \u0000, or
// a \u escape of a UTF-16 surrogate that is not part of a pair.
func unstorableJSON(s string) string {
	if !utf8.ValidString(s) {
		return "invalid UTF-8"
	}
	inString := false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"':
			inString = !inString
		case c == '\\' && inString:
			if i+1 < len(s) && s[i+1] == 'u' && i+6 <= len(s) {
				r, _ := strconv.ParseUint(s[i+2:i+6], 16, 32)
				switch {
				case r == 0:
					return `the escape \u0000`
				case r >= 0xD800 && r < 0xDC00:
					next := uint64(0)
					if i+12 <= len(s) && s[i+6] == '\\' && s[i+7] == 'u' {
						next, _ = strconv.ParseUint(s[i+8:i+12], 16, 32)
					}
					if next < 0xDC00 || next >= 0xE000 {
						return "an unpaired high surrogate escape"
					}
					i += 6
				case r >= 0xDC00 && r < 0xE000:
					return "an unpaired low surrogate escape"
				}
				i += 5
			} else {
				i++ // the escaped character
			}
		}
	}
	return ""
}

// FuzzTableName checks WithTable against arbitrary names: a name is
// accepted if and only if it is a plain identifier (a letter or underscore,
// then letters, digits or underscores) of at most 43 characters. Names
// that SQLite reserves for itself (sqlite_...) may be rejected too. A
// rejection wraps ErrInvalidOption and quotes the name. An accepted name
// really works: on a temporary SQLite file, AutoMigrate creates the table
// and its sequence table, a write lands in them, and a dispatcher delivers
// it from there.
func FuzzTableName(f *testing.F) {
	for _, name := range []string{
		"outbox_records", "Events_2", "_", "a", "_9", "Z", "order", "select", "outbox_records_sequences", "pg_events",
		strings.Repeat("a", 43), strings.Repeat("a", 44), strings.Repeat("_", 43),
		"", "1abc", "a-b", "a b", `a"b`, "a;drop table x", "public.outbox", "é", "events\n", "\nevents", "a\x00b", "ＡＢＣ",
	} {
		f.Add(name)
	}
	f.Fuzz(func(t *testing.T, name string) {
		err := validateTable(name)
		plain := isPlainIdentifier(name)
		reserved := strings.HasPrefix(strings.ToLower(name), "sqlite_")
		switch {
		case err != nil && !errors.Is(err, ErrInvalidOption):
			t.Fatalf("WithTable(%q): %v, which does not wrap ErrInvalidOption", name, err)
		case err != nil && !strings.Contains(err.Error(), strconv.Quote(name)):
			t.Fatalf("WithTable(%q): %v, which does not quote the name", name, err)
		case err != nil && plain && !reserved:
			t.Fatalf("WithTable(%q) rejected a plain identifier: %v", name, err)
		case err == nil && !plain:
			t.Fatalf("WithTable(%q) accepted a name that is not a plain identifier of at most 43 characters", name)
		case err != nil:
			return
		}

		// Not outboxtest.Open: the fuzzer's test names contain '#', which
		// ends the path of a SQLite file: URI (see
		// TestSQLiteTestDatabasesAreSeparate).
		dir, err := os.MkdirTemp("", "outbox-fuzz-table")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		db, err := gorm.Open(outboxtest.Dialector(outboxtest.SQLite, outboxtest.SQLiteDSN(filepath.Join(dir, "outbox.db"))), &gorm.Config{Logger: logger.Discard})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if sqlDB, err := db.DB(); err == nil {
				sqlDB.Close()
			}
		})
		p := Plugin(WithTable(name))
		if err := db.Use(p); err != nil {
			t.Fatalf("WithTable(%q): db.Use: %v", name, err)
		}
		if err := AutoMigrate(db); err != nil {
			t.Fatalf("WithTable(%q): AutoMigrate: %v", name, err)
		}
		if err := Publish(db, Event{Type: "t", AggregateType: "a", AggregateID: "1", Payload: map[string]string{"table": name}}); err != nil {
			t.Fatalf("WithTable(%q): Publish: %v", name, err)
		}
		var rows []struct {
			EventType         string
			AggregateSequence int64
			Payload           string
		}
		if err := db.Raw(`SELECT event_type, aggregate_sequence, payload FROM ` + dialect.TablesFor(name).Records).Scan(&rows).Error; err != nil {
			t.Fatalf("WithTable(%q): read back: %v", name, err)
		}
		var last int64
		if err := db.Raw(`SELECT last_sequence FROM ` + dialect.TablesFor(name).Sequences).Scan(&last).Error; err != nil {
			t.Fatalf("WithTable(%q): read sequences: %v", name, err)
		}
		if len(rows) != 1 || rows[0].EventType != "t" || rows[0].AggregateSequence != 1 || last != 1 || !strings.Contains(rows[0].Payload, "table") {
			t.Fatalf("WithTable(%q): read back %+v and last sequence %d, want the one event with sequence 1", name, rows, last)
		}
		var got []Message
		d, err := NewDispatcher(db, PublisherFunc(func(_ context.Context, b Batch) error {
			got = append(got, b.Messages...)
			return nil
		}))
		if err != nil {
			t.Fatal(err)
		}
		if n, err := d.DispatchOnce(context.Background()); n != 1 || err != nil || len(got) != 1 {
			t.Fatalf("WithTable(%q): DispatchOnce = %d, %v; want the event delivered", name, n, err)
		}
	})
}

// isPlainIdentifier is the rule WithTable documents, written out without
// a regular expression: 1 to 43 characters, the first an ASCII letter or
// underscore, the others ASCII letters, digits or underscores.
func isPlainIdentifier(s string) bool {
	if len(s) == 0 || len(s) > 43 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		letter := c == '_' || ('a' <= c && c <= 'z') || ('A' <= c && c <= 'Z')
		digit := '0' <= c && c <= '9'
		if !letter && !(digit && i > 0) {
			return false
		}
	}
	return true
}
