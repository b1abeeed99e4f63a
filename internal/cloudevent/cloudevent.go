// Package cloudevent maps an outbox message to the attributes of a
// CloudEvent, for the broker publishers' binary content mode. Each
// publisher writes these attributes with its binding's prefix (ce- on NATS,
// ce_ on Kafka, cloudEvents_ on AMQP, plain field names on Redis); the
// event's payload is the message body, byte for byte.
package cloudevent

import (
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/gorm-outbox/outbox"
)

// DefaultSource is the CloudEvents source of every event when a publisher
// is given none: a URI-reference naming this library.
const DefaultSource = "gorm-outbox"

// CheckSource reports whether source can be a CloudEvents source, which
// the specification makes a non-empty URI-reference: it refuses the empty
// string, white space and control characters (which no URI-reference
// holds, and which some bindings' headers cannot carry), and what
// net/url cannot parse.
func CheckSource(source string) error {
	if source == "" {
		return errors.New("empty source")
	}
	if strings.IndexFunc(source, func(r rune) bool { return r <= ' ' || r == 0x7f }) >= 0 {
		return fmt.Errorf("%q holds white space or a control character", source)
	}
	if _, err := url.Parse(source); err != nil {
		return fmt.Errorf("%q is not a URI-reference: %w", source, err)
	}
	return nil
}

// ContentType is the datacontenttype of every event: the outbox stores JSON.
const ContentType = "application/json"

// Attribute is one CloudEvents context attribute, named as the
// specification names it (lower-case letters and digits).
type Attribute struct {
	Name, Value string
}

// Key is the aggregate key of m, "type/id": the subject, the partitionkey
// extension, and where a broker partitions (a Kafka record key) the key
// that keeps one aggregate in one partition.
func Key(m outbox.Message) string { return m.AggregateType + "/" + m.AggregateID }

// Attributes returns the context attributes of m, in a fixed order: the
// required id, source, specversion and type; then time, subject,
// datacontenttype, the Partitioning extension partitionkey, and the
// extensions aggregatetype, aggregateid and aggregatesequence (an integer).
// datacontenttype is included; a binding that carries it in a property of
// its own (AMQP's content-type) leaves it out of the headers.
func Attributes(m outbox.Message, source string) []Attribute {
	if source == "" {
		source = DefaultSource
	}
	return []Attribute{
		{"id", m.EventID},
		{"source", source},
		{"specversion", "1.0"},
		{"type", m.EventType},
		{"time", m.OccurredAt.UTC().Format(time.RFC3339Nano)},
		{"subject", Key(m)},
		{"datacontenttype", ContentType},
		{"partitionkey", Key(m)},
		{"aggregatetype", m.AggregateType},
		{"aggregateid", m.AggregateID},
		{"aggregatesequence", strconv.FormatInt(m.Sequence, 10)},
	}
}
