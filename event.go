package outbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// Op names the kind of write that produced an event.
type Op string

// The write operations the plugin reports to an [Emitter].
const (
	OpCreate Op = "create"
	OpUpdate Op = "update"
	OpDelete Op = "delete"
)

// Event is a fact to record in the outbox, in the same transaction as the
// business write it describes.
//
// Type, AggregateType and AggregateID are required; ID, Type,
// AggregateType, AggregateID and IdempotencyKey may be at most 255
// characters long ([MaxEventTypeLength] and the others). ID defaults to a fresh
// UUIDv7, IdempotencyKey to ID and OccurredAt to the current time. Payload
// is encoded with encoding/json; a json.RawMessage or []byte is stored as is
// and must be valid JSON. A nil Payload is stored as JSON null.
//
// Writing an event whose IdempotencyKey is already in the outbox is a no-op
// that returns no error and leaves the existing row untouched, for as long
// as that row exists (cleanup of delivered rows frees their keys).
type Event struct {
	ID             string
	Type           string
	AggregateType  string
	AggregateID    string
	IdempotencyKey string
	Payload        any
	Headers        map[string]string
	OccurredAt     time.Time
}

// Emitter is implemented by models that record events when they are
// written. The plugin calls OutboxEvents once for every row that a create,
// update or delete of the model inserted, updated or deleted, on a model
// value filled from the row as the database stored it (as it was, for a
// delete), and records the events it returns in the same transaction. A
// statement's own model value is the one called where the row is one of
// its rows (so fields that are not columns, associations say, are as the
// caller set them, and the columns as stored); a row written by condition
// gets a fresh model value. op is OpCreate for a row inserted, OpUpdate
// for one updated (an upsert's update too), OpDelete for one deleted or
// soft-deleted.
//
// OutboxEvents must be a pure function of the model: no I/O. An error it
// returns fails the business write, and nothing is written. The method may
// have a value or a pointer receiver.
type Emitter interface {
	OutboxEvents(op Op) ([]Event, error)
}

// The longest text an Event's identifying fields may hold, counted in
// characters (Unicode code points). The limits are checked before anything
// is written, the same on every engine, so that an event that works on
// SQLite in development does not fail in production on an index that
// cannot hold it: an event over a limit fails with [ErrInvalidEvent], and
// the error quotes at most the first 64 characters of any value.
const (
	MaxEventIDLength        = 255
	MaxEventTypeLength      = 255
	MaxAggregateTypeLength  = 255
	MaxAggregateIDLength    = 255
	MaxIdempotencyKeyLength = 255
)

// DefaultMaxPayloadBytes is the longest encoded payload (its JSON text, in
// bytes) an event may have unless [WithMaxPayloadBytes] says otherwise:
// 1 MiB.
const DefaultMaxPayloadBytes = 1 << 20

// WithMaxPayloadBytes sets the longest encoded payload an event may have,
// counted in bytes of its JSON text as stored (default
// [DefaultMaxPayloadBytes]). A longer one fails the write with
// [ErrInvalidEvent], naming its size and the limit, before anything is
// written: the business write of a model that emits it fails and leaves
// nothing behind, and [Publish] writes none of its events. It holds for
// model emitters and Publish alike, the same on every engine, so that an
// event too big for a broker fails where it is made rather than at
// delivery. n must be greater than 0; otherwise db.Use fails with
// [ErrInvalidOption].
func WithMaxPayloadBytes(n int) Option {
	return func(p *OutboxPlugin) error {
		if n <= 0 {
			return fmt.Errorf("%w: WithMaxPayloadBytes: %d is not greater than 0", ErrInvalidOption, n)
		}
		p.maxPayload = n
		return nil
	}
}

// payloadLimit is the longest encoded payload p writes.
func (p *OutboxPlugin) payloadLimit() int {
	if p.maxPayload == 0 {
		return DefaultMaxPayloadBytes
	}
	return p.maxPayload
}

// shortLen is how many characters of a value an error message quotes.
const shortLen = 64

// short returns s, or its first shortLen characters and an ellipsis.
func short(s string) string {
	n := 0
	for i := range s {
		if n == shortLen {
			return s[:i] + "…"
		}
		n++
	}
	return s
}

// encode validates e, fills its defaults and encodes its payload and
// headers. Every error wraps ErrInvalidEvent.
func (e Event) encode(now time.Time) (dialect.Record, error) {
	switch {
	case e.Type == "":
		return dialect.Record{}, fmt.Errorf("%w: Type is empty", ErrInvalidEvent)
	case e.AggregateType == "":
		return dialect.Record{}, fmt.Errorf("%w %q: AggregateType is empty", ErrInvalidEvent, short(e.Type))
	case e.AggregateID == "":
		return dialect.Record{}, fmt.Errorf("%w %q: AggregateID is empty", ErrInvalidEvent, short(e.Type))
	}
	for _, f := range []struct {
		name, value string
		max         int
	}{
		{"Type", e.Type, MaxEventTypeLength}, {"AggregateType", e.AggregateType, MaxAggregateTypeLength},
		{"AggregateID", e.AggregateID, MaxAggregateIDLength}, {"ID", e.ID, MaxEventIDLength},
		{"IdempotencyKey", e.IdempotencyKey, MaxIdempotencyKeyLength},
	} {
		if n := utf8.RuneCountInString(f.value); n > f.max {
			return dialect.Record{}, fmt.Errorf("%w %q: %s is %d characters long, more than the %d allowed", ErrInvalidEvent, short(e.Type), f.name, n, f.max)
		}
		if err := storableText(f.value); err != nil {
			return dialect.Record{}, fmt.Errorf("%w %q: %s %w", ErrInvalidEvent, short(e.Type), f.name, err)
		}
	}
	for k, v := range e.Headers {
		if err := errors.Join(storableText(k), storableText(v)); err != nil {
			return dialect.Record{}, fmt.Errorf("%w %q: header %q: %w", ErrInvalidEvent, e.Type, short(k), err)
		}
	}
	enc := dialect.Record{
		ID:            e.ID,
		Type:          e.Type,
		AggregateType: e.AggregateType,
		AggregateID:   e.AggregateID,
		Key:           e.IdempotencyKey,
		OccurredAt:    e.OccurredAt,
	}
	if enc.ID == "" {
		id, err := uuid.NewV7()
		if err != nil {
			return dialect.Record{}, fmt.Errorf("outbox: event %q: generate ID: %w", e.Type, err)
		}
		enc.ID = id.String()
	}
	if enc.Key == "" {
		enc.Key = enc.ID
	}
	if enc.OccurredAt.IsZero() {
		enc.OccurredAt = now
	}
	payload, err := encodePayload(e.Payload)
	if err != nil {
		return dialect.Record{}, fmt.Errorf("%w %q: payload: %w", ErrInvalidEvent, e.Type, err)
	}
	enc.Payload = payload
	if e.Headers != nil {
		h, err := json.Marshal(e.Headers)
		if err != nil {
			return dialect.Record{}, fmt.Errorf("%w %q: headers: %w", ErrInvalidEvent, e.Type, err)
		}
		s := string(h)
		enc.Headers = &s
	}
	return enc, nil
}

func encodePayload(p any) (string, error) {
	var raw []byte
	switch v := p.(type) {
	case json.RawMessage:
		raw = v
	case []byte:
		raw = v
	default:
		b, err := json.Marshal(v)
		if err != nil {
			return "", err
		}
		return string(b), storableJSON(string(b))
	}
	if !json.Valid(raw) {
		return "", fmt.Errorf("raw payload is not valid JSON (%d bytes)", len(raw))
	}
	return string(raw), storableJSON(string(raw))
}

// storableText rejects what no engine stores the same way: invalid UTF-8,
// which PostgreSQL refuses, and NUL, which text columns cannot hold.
func storableText(s string) error {
	switch {
	case !utf8.ValidString(s):
		return errors.New("is not valid UTF-8")
	case strings.IndexByte(s, 0) >= 0:
		return errors.New("contains a NUL character")
	}
	return nil
}

// storableJSON rejects valid JSON text that PostgreSQL's jsonb refuses, so
// that an event that works on SQLite in development does not fail in
// production: invalid UTF-8, the escape \u0000, and \u escapes of UTF-16
// surrogates that do not form a pair. In valid JSON every backslash starts
// an escape inside a string, so no string tracking is needed.
func storableJSON(s string) error {
	if !utf8.ValidString(s) {
		return errors.New("is not valid UTF-8")
	}
	for i := 0; i < len(s); i++ {
		if s[i] != '\\' {
			continue
		}
		i++ // the escaped character
		if s[i] != 'u' {
			continue
		}
		r := hex4(s[i+1 : i+5])
		i += 4
		switch {
		case r == 0:
			return errors.New(`contains \u0000, which PostgreSQL cannot store`)
		case r >= 0xDC00 && r < 0xE000:
			return errors.New("contains an unpaired low surrogate escape")
		case r >= 0xD800 && r < 0xDC00:
			if i+6 < len(s) && s[i+1] == '\\' && s[i+2] == 'u' {
				if lo := hex4(s[i+3 : i+7]); lo >= 0xDC00 && lo < 0xE000 {
					i += 6
					continue
				}
			}
			return errors.New("contains an unpaired high surrogate escape")
		}
	}
	return nil
}

// hex4 decodes the four hex digits of a JSON \u escape.
func hex4(s string) rune {
	n, _ := strconv.ParseUint(s, 16, 16)
	return rune(n)
}
