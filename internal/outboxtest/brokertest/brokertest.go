// Package brokertest holds what the tests of the broker publishers
// (outboxnats, outboxamqp, outboxkafka, outboxredis) share, so that each
// package's tests state only what is particular to its broker:
//
//   - the server's address from the environment, with the suite's skip or
//     fail policy ([Server]);
//   - messages and batches over aggregates as a dispatcher hands them to a
//     publisher ([Message], [Interleaved], [Publish], [Failures]);
//   - the publisher-side promises: invalid options refused, an oversized
//     message failed permanently and its aggregate held back, a deadline
//     that cuts a batch or ends a wait for an answer ([CheckNewRejects],
//     [CheckOversizedMessageFails], [CheckDeadlineCutsTheBatch],
//     [CheckUnansweredBatchFailsByTheDeadline]);
//   - reading what a consumer got as CloudEvents through the SDK and
//     checking their attributes ([Binary], [Event], [CheckEvent]);
//   - the consumer-side promises: every committed event arrives, nothing
//     else does, each aggregate's in sequence order ([CheckDelivered],
//     [CheckInOrder]), and what a batch published twice leaves
//     ([CheckDuplicateBatch]);
//   - a dispatcher run end to end on a real SQLite outbox ([OpenOutbox],
//     [WriteEvents], [DeliverAll], [Dispatch],
//     [CheckOversizedEventIsDeadLettered]);
//   - dispatcher processes killed with SIGKILL and replaced ([Main],
//     [Processes]).
//
// Every check runs against the real broker the calling test set up; the
// package knows no broker. It lives apart from outboxtest, which the root
// package's internal tests import, because it needs the root's types.
package brokertest

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// Server is a broker server the tests reach at an address taken from the
// environment.
type Server struct {
	// Name names the server in messages: "NATS", "RabbitMQ", "Redis".
	Name string
	// Env is the variable that holds the address, such as OUTBOX_NATS_URL.
	Env string
	// Default is the address when Env is unset or empty: where the
	// development machine runs the server.
	Default string
}

// Addr returns the value of s.Env, or s.Default when it is unset or empty.
func (s Server) Addr() string {
	if a := os.Getenv(s.Env); a != "" {
		return a
	}
	return s.Default
}

// Unreachable ends t because s did not answer with err: t skips with a
// message naming s.Env, or, under CI=true, fails (see
// [outboxtest.Unreachable]).
func (s Server) Unreachable(t testing.TB, err error) {
	t.Helper()
	outboxtest.Unreachable(t, s.Name, s.Addr(), s.Env, err)
}

// occurred is when event number 0 of every aggregate occurred; event
// number seq occurred seq seconds later. The fraction of a second shows
// whether a publisher keeps it.
var occurred = time.Date(2024, 5, 6, 7, 8, 9, 123456000, time.UTC)

// Message returns event number seq of aggregate agg, written "type/id"
// ("order/42"), as a dispatcher hands it to a publisher at its first
// attempt: event id and idempotency key "evt-<type>-<id>-<seq>", event type
// "<type>.changed", a small JSON object as payload, and an occurrence time
// with microseconds that grows by a second with seq. The ids repeat from
// test to test: each test publishes to a stream, queue or topic of its own.
func Message(agg string, seq int64) outbox.Message {
	typ, id, ok := strings.Cut(agg, "/")
	if !ok {
		panic(fmt.Sprintf("brokertest: aggregate %q is not type/id", agg))
	}
	evID := fmt.Sprintf("evt-%s-%s-%d", typ, id, seq)
	return outbox.Message{
		EventID: evID, EventType: typ + ".changed", AggregateType: typ, AggregateID: id,
		Sequence: seq, IdempotencyKey: evID,
		Payload:    json.RawMessage(fmt.Sprintf(`{"aggregate":%q,"sequence":%d}`, agg, seq)),
		OccurredAt: occurred.Add(time.Duration(seq) * time.Second),
		Attempt:    1,
	}
}

// Interleaved returns events 1 to n of each of aggs, interleaved as a
// claim returns a backlog: sequence 1 of every aggregate in the order of
// aggs, then sequence 2, and so on.
func Interleaved(n int, aggs ...string) []outbox.Message {
	var msgs []outbox.Message
	for seq := int64(1); seq <= int64(n); seq++ {
		for _, agg := range aggs {
			msgs = append(msgs, Message(agg, seq))
		}
	}
	return msgs
}

// IDs returns the event ids of msgs, as a set.
func IDs(msgs []outbox.Message) map[string]bool {
	ids := make(map[string]bool, len(msgs))
	for _, m := range msgs {
		ids[m.EventID] = true
	}
	return ids
}
