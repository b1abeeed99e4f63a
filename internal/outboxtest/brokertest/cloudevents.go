package brokertest

import (
	"bytes"
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/binding/spec"
	"github.com/cloudevents/sdk-go/v2/event"

	"github.com/gorm-outbox/outbox"
)

// Binary is a message in CloudEvents binary content mode, as its
// protocol binding reads it off the wire. Attributes maps every context
// attribute and extension by its name in the specification ("id",
// "datacontenttype", "aggregatesequence") to its value, with the
// binding's prefix and encoding undone (the caller does that part: it is
// what differs from broker to broker); Data is the message body.
type Binary struct {
	Attributes map[string]string
	Data       []byte
}

// specVersions are the CloudEvents versions, their attributes named
// without a binding's prefix, as Binary names them.
var specVersions = spec.New()

// Event turns b into an event with the CloudEvents SDK and validates it,
// failing t when the SDK cannot read b or finds the event invalid.
func Event(t testing.TB, b Binary) *event.Event {
	t.Helper()
	msg := binaryMessage{b: b, version: specVersions.Version(b.Attributes["specversion"])}
	if msg.version == nil {
		t.Fatalf("not a binary-mode CloudEvent: specversion %q (attributes %v)", b.Attributes["specversion"], b.Attributes)
	}
	e, err := binding.ToEvent(context.Background(), msg)
	if err != nil {
		t.Fatalf("CloudEvents SDK cannot read the message: %v (attributes %v)", err, b.Attributes)
	}
	if err := e.Validate(); err != nil {
		t.Fatalf("CloudEvents SDK: invalid event: %v (attributes %v)", err, b.Attributes)
	}
	return e
}

// binaryMessage is b as a binding.MessageReader and
// binding.MessageMetadataReader, for binding.ToEvent.
type binaryMessage struct {
	b       Binary
	version spec.Version
}

func (m binaryMessage) ReadEncoding() binding.Encoding { return binding.EncodingBinary }

func (m binaryMessage) ReadStructured(context.Context, binding.StructuredWriter) error {
	return binding.ErrNotStructured
}

func (m binaryMessage) ReadBinary(_ context.Context, w binding.BinaryWriter) error {
	for name, v := range m.b.Attributes {
		var err error
		if attr := m.version.Attribute(name); attr != nil {
			err = w.SetAttribute(attr, v)
		} else {
			err = w.SetExtension(name, v)
		}
		if err != nil {
			return fmt.Errorf("attribute %s: %w", name, err)
		}
	}
	return w.SetData(bytes.NewReader(m.b.Data))
}

func (m binaryMessage) GetAttribute(k spec.Kind) (spec.Attribute, any) {
	attr := m.version.AttributeFromKind(k)
	if attr == nil {
		return nil, nil
	}
	if v, ok := m.b.Attributes[attr.Name()]; ok {
		return attr, v
	}
	return attr, nil
}

func (m binaryMessage) GetExtension(name string) any {
	if v, ok := m.b.Attributes[name]; ok && m.version.Attribute(name) == nil {
		return v
	}
	return nil
}

// CheckEvent checks that e is the CloudEvent of m that every broker
// publisher writes, with source as its source: id, type, source,
// specversion 1.0, time (to the nanosecond), subject and partitionkey
// "<aggregate type>/<aggregate id>", datacontenttype application/json,
// the aggregatetype, aggregateid and aggregatesequence extensions, the
// payload byte for byte as data, and no sequence extension (the
// aggregate's sequence is aggregatesequence; CloudEvents' sequence
// extension orders a whole source).
func CheckEvent(t testing.TB, e *event.Event, m outbox.Message, source string) {
	t.Helper()
	key := m.AggregateType + "/" + m.AggregateID
	ext := e.Extensions()
	checks := []struct{ name, got, want string }{
		{"id", e.ID(), m.EventID},
		{"type", e.Type(), m.EventType},
		{"source", e.Source(), source},
		{"specversion", e.SpecVersion(), "1.0"},
		{"time", e.Time().UTC().Format(time.RFC3339Nano), m.OccurredAt.UTC().Format(time.RFC3339Nano)},
		{"subject", e.Subject(), key},
		{"datacontenttype", e.DataContentType(), "application/json"},
		{"partitionkey", extension(ext, "partitionkey"), key},
		{"aggregatetype", extension(ext, "aggregatetype"), m.AggregateType},
		{"aggregateid", extension(ext, "aggregateid"), m.AggregateID},
		{"aggregatesequence", extension(ext, "aggregatesequence"), strconv.FormatInt(m.Sequence, 10)},
		{"data", string(e.Data()), string(m.Payload)},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("event %s: %s = %q, want %q", m.EventID, c.name, c.got, c.want)
		}
	}
	if v, ok := ext["sequence"]; ok {
		t.Errorf("event %s carries the CloudEvents sequence extension (%v); the aggregate's sequence is aggregatesequence", m.EventID, v)
	}
}

// extension returns extension name of an event as a string, or "<none>".
func extension(ext map[string]any, name string) string {
	v, ok := ext[name]
	if !ok {
		return "<none>"
	}
	return fmt.Sprint(v)
}

// aggregateOf reads e's aggregate and sequence from its extensions, as
// the message the outbox handed over, failing t when they are missing.
func aggregateOf(t testing.TB, e *event.Event) outbox.Message {
	t.Helper()
	ext := e.Extensions()
	seq, err := strconv.ParseInt(extension(ext, "aggregatesequence"), 10, 64)
	if err != nil {
		t.Fatalf("event %s: aggregatesequence: %v", e.ID(), err)
	}
	typ, id := extension(ext, "aggregatetype"), extension(ext, "aggregateid")
	if _, ok := ext["aggregatetype"]; !ok {
		t.Fatalf("event %s has no aggregatetype", e.ID())
	}
	if _, ok := ext["aggregateid"]; !ok {
		t.Fatalf("event %s has no aggregateid", e.ID())
	}
	return outbox.Message{EventID: e.ID(), AggregateType: typ, AggregateID: id, Sequence: seq}
}
