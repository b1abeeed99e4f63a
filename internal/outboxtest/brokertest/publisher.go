package brokertest

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox"
)

// Publish hands msgs to p as one batch, with ten seconds to finish, and
// returns what Publish returned. The batch's id is "batch-" and its first
// message's id.
func Publish(t testing.TB, p outbox.Publisher, msgs ...outbox.Message) error {
	t.Helper()
	return publishWithin(t, p, 10*time.Second, msgs...)
}

// oversizedWait is how long CheckOversizedMessageFails gives its batch: a
// broker may refuse a message only once it has received the whole of it
// (RabbitMQ's 128 MiB limit), which on a loaded machine under the race
// detector took longer than Publish's ten seconds.
const oversizedWait = time.Minute

func publishWithin(t testing.TB, p outbox.Publisher, wait time.Duration, msgs ...outbox.Message) error {
	t.Helper()
	if len(msgs) == 0 {
		t.Fatal("brokertest: Publish of no messages")
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	return p.Publish(ctx, outbox.Batch{ID: "batch-" + msgs[0].EventID, Messages: msgs})
}

// Failures returns the failures err reports per event id, failing t when
// err is not an *outbox.PartialError.
func Failures(t testing.TB, err error) map[string]error {
	t.Helper()
	var pe *outbox.PartialError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish = %v, want a *outbox.PartialError", err)
	}
	return pe.Failed
}

// CheckInvalidOption checks that err, what a publisher's New returned, is
// an outbox.ErrInvalidOption whose message names naming (the option or
// argument at fault).
func CheckInvalidOption(t testing.TB, err error, naming string) {
	t.Helper()
	if !errors.Is(err, outbox.ErrInvalidOption) || !strings.Contains(err.Error(), naming) {
		t.Errorf("New = %v, want ErrInvalidOption naming %s", err, naming)
	}
}

// CheckDeadlineCutsTheBatch publishes events 1 to 1,000 of order/1 and
// order/2, interleaved, through p with a context that expires after 3ms,
// and checks that Publish returns within 500ms with a
// *outbox.PartialError in which each aggregate's messages are an accepted
// prefix followed only by failures, none of them permanent, with at least
// one failure. It returns the batch's messages, for the caller to check
// what the broker holds or publish them again.
func CheckDeadlineCutsTheBatch(t testing.TB, p outbox.Publisher) []outbox.Message {
	t.Helper()
	msgs := Interleaved(1000, "order/1", "order/2")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := p.Publish(ctx, outbox.Batch{ID: "batch-" + msgs[0].EventID, Messages: msgs})
	if took := time.Since(start); took > 500*time.Millisecond {
		t.Errorf("Publish took %v with a 3ms deadline", took)
	}
	failed := Failures(t, err)
	failedFrom := map[string]bool{}
	for _, m := range msgs {
		key := m.AggregateType + "/" + m.AggregateID
		e, isFailed := failed[m.EventID]
		switch {
		case isFailed && outbox.IsPermanent(e):
			t.Fatalf("%s: %v, want a retryable failure", m.EventID, e)
		case isFailed:
			failedFrom[key] = true
		case failedFrom[key]:
			t.Fatalf("%s accepted after a failed message of its aggregate", m.EventID)
		}
	}
	if len(failedFrom) == 0 {
		t.Fatal("every message accepted within 3ms: the deadline did not cut the batch")
	}
	return msgs
}

// CheckOversizedMessageFails publishes events 1 to 3 of order/1 and
// event 1 of order/2 through p as one batch, with a minute to finish,
// event 2 of order/1 with payload, which p's broker must refuse as too
// large. It checks that event 2 failed
// permanently, with an error that wraps cause unless cause is nil, and
// that event 3, behind it in its aggregate, was not attempted. It returns
// the failures, for the caller to check what its broker does with the
// others.
func CheckOversizedMessageFails(t testing.TB, p outbox.Publisher, payload []byte, cause error) map[string]error {
	t.Helper()
	big := Message("order/1", 2)
	big.Payload = payload
	after := Message("order/1", 3)
	failed := Failures(t, publishWithin(t, p, oversizedWait, Message("order/1", 1), big, after, Message("order/2", 1)))
	if e := failed[big.EventID]; !outbox.IsPermanent(e) || (cause != nil && !errors.Is(e, cause)) {
		t.Errorf("oversized message %s: %v, want a permanent failure (wrapping %v)", big.EventID, e, cause)
	}
	if e := failed[after.EventID]; !errors.Is(e, outbox.ErrNotAttempted) {
		t.Errorf("message %s after it in its aggregate: %v, want ErrNotAttempted", after.EventID, e)
	}
	return failed
}

// CheckUnansweredBatchFailsByTheDeadline publishes events 1 and 2 of
// order/1 and event 1 of order/2 through p, whose broker does not answer,
// with a context that expires after deadline. It checks that Publish
// returns within limit, that the first event of each aggregate failed
// with a retryable error, one that wraps cause unless cause is nil, and
// that the second event of order/1 was not attempted.
func CheckUnansweredBatchFailsByTheDeadline(t testing.TB, p outbox.Publisher, deadline, limit time.Duration, cause error) {
	t.Helper()
	msgs := []outbox.Message{Message("order/1", 1), Message("order/1", 2), Message("order/2", 1)}
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	start := time.Now()
	err := p.Publish(ctx, outbox.Batch{ID: "batch-" + msgs[0].EventID, Messages: msgs})
	if took := time.Since(start); took > limit {
		t.Errorf("Publish took %v with a %v deadline, more than %v", took, deadline, limit)
	}
	failed := Failures(t, err)
	for _, m := range []outbox.Message{msgs[0], msgs[2]} {
		e := failed[m.EventID]
		switch {
		case e == nil || outbox.IsPermanent(e) || errors.Is(e, outbox.ErrNotAttempted):
			t.Errorf("%s: %v, want a retryable failure", m.EventID, e)
		case cause != nil && !errors.Is(e, cause):
			t.Errorf("%s: %v, want a retryable failure wrapping %v", m.EventID, e, cause)
		}
	}
	if e := failed[msgs[1].EventID]; !errors.Is(e, outbox.ErrNotAttempted) {
		t.Errorf("%s: %v, want ErrNotAttempted behind %s", msgs[1].EventID, e, msgs[0].EventID)
	}
}

// Rejected is a call of a publisher's New that must fail: given Client
// (the broker client New takes, its zero value for none) and Options, New
// must return an outbox.ErrInvalidOption whose message names Naming.
type Rejected[C, O any] struct {
	Name    string // the subtest's name
	Client  C
	Options []O
	Naming  string
}

// CheckNewRejects runs each of cases as a subtest that calls newPublisher
// (a publisher package's New) and checks its error as
// [CheckInvalidOption] does.
func CheckNewRejects[C, O, P any](t *testing.T, newPublisher func(C, ...O) (P, error), cases []Rejected[C, O]) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			_, err := newPublisher(c.Client, c.Options...)
			CheckInvalidOption(t, err, c.Naming)
		})
	}
}
