package brokertest

import (
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/cloudevents/sdk-go/v2/event"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/cloudevent"
	"github.com/gorm-outbox/outbox/internal/outboxtest/deliveries"
)

// recorder is a testing.TB that records failures instead of reporting
// them, for checking that the kit's checks fail when they must.
type recorder struct {
	testing.TB // nil: the kit calls only the methods below
	failures   []string
}

func (r *recorder) Helper()             {}
func (r *recorder) Logf(string, ...any) {}
func (r *recorder) Errorf(format string, args ...any) {
	r.failures = append(r.failures, fmt.Sprintf(format, args...))
}
func (r *recorder) Fatalf(format string, args ...any) { r.Errorf(format, args...); runtime.Goexit() }
func (r *recorder) Fatal(args ...any)                 { r.Fatalf("%s", fmt.Sprint(args...)) }

// failures runs check with a recorder, as a test goroutine, and returns
// what it failed with.
func failures(check func(t testing.TB)) []string {
	r := &recorder{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		check(r)
	}()
	<-done
	return r.failures
}

// wantFailure fails t unless got holds a failure containing want.
func wantFailure(t *testing.T, got []string, want string) {
	t.Helper()
	for _, f := range got {
		if strings.Contains(f, want) {
			return
		}
	}
	t.Errorf("failures %q, want one containing %q", got, want)
}

// binary is m as a publisher writes it: the attributes of the library's
// mapping, the payload as the body.
func binary(m outbox.Message, source string) Binary {
	b := Binary{Attributes: map[string]string{}, Data: m.Payload}
	for _, a := range cloudevent.Attributes(m, source) {
		b.Attributes[a.Name] = a.Value
	}
	return b
}

func eventsOf(t testing.TB, msgs ...outbox.Message) []*event.Event {
	var out []*event.Event
	for _, m := range msgs {
		out = append(out, Event(t, binary(m, "/test")))
	}
	return out
}

func TestCheckEventAcceptsThePublishersMappingAndNothingLess(t *testing.T) {
	m := Message("order/42", 3)
	if got := failures(func(t testing.TB) { CheckEvent(t, Event(t, binary(m, "/shop")), m, "/shop") }); len(got) != 0 {
		t.Fatalf("the publishers' own mapping fails CheckEvent: %q", got)
	}

	noSeq := binary(m, "/shop")
	delete(noSeq.Attributes, "aggregatesequence")
	wantFailure(t, failures(func(t testing.TB) { CheckEvent(t, Event(t, noSeq), m, "/shop") }), "aggregatesequence")

	withSequence := binary(m, "/shop")
	withSequence.Attributes["sequence"] = "3"
	wantFailure(t, failures(func(t testing.TB) { CheckEvent(t, Event(t, withSequence), m, "/shop") }), "sequence extension")

	wantFailure(t, failures(func(t testing.TB) { CheckEvent(t, Event(t, binary(m, "/shop")), m, "/other") }), "source")

	noVersion := binary(m, "/shop")
	delete(noVersion.Attributes, "specversion")
	wantFailure(t, failures(func(t testing.TB) { Event(t, noVersion) }), "not a binary-mode CloudEvent")
}

func TestCheckDeliveredFindsLossStrangersAndDisorder(t *testing.T) {
	a1, a2, a3, b1 := Message("order/a", 1), Message("order/a", 2), Message("order/a", 3), Message("order/b", 1)
	want := IDs([]outbox.Message{a1, a2, a3, b1})

	var copies map[string]int
	got := failures(func(t testing.TB) {
		// A redelivery of a1 after a2 keeps the promise.
		copies = CheckDelivered(t, eventsOf(t, a1, b1, a2, a1, a3), want)
	})
	if len(got) != 0 || copies[a1.EventID] != 2 || copies[a3.EventID] != 1 {
		t.Fatalf("in-order delivery with a redelivery: failures %q, copies %v", got, copies)
	}
	wantFailure(t, failures(func(t testing.TB) { CheckEachOnce(t, copies) }), a1.EventID)

	wantFailure(t, failures(func(t testing.TB) { CheckDelivered(t, eventsOf(t, a1, a2, b1), want) }), a3.EventID+" never arrived")
	wantFailure(t, failures(func(t testing.TB) { CheckDelivered(t, eventsOf(t, a1, a3, a2, b1), want) }), "out of order")
	stranger := Message("order/c", 1)
	wantFailure(t, failures(func(t testing.TB) { CheckDelivered(t, eventsOf(t, a1, a2, a3, b1, stranger), want) }), stranger.EventID)
}

func TestCheckDuplicateBatchCountsTheCopies(t *testing.T) {
	for _, c := range []struct {
		kept, want int
		fails      bool
	}{{2, 2, false}, {1, 1, false}, {2, 1, true}, {1, 2, true}} {
		t.Run(fmt.Sprintf("broker keeps %d, want %d", c.kept, c.want), func(t *testing.T) {
			var r deliveries.Recorder
			read := func() []*event.Event {
				var out []*event.Event
				seen := map[string]int{}
				for _, m := range r.Accepted() {
					if seen[m.EventID]++; seen[m.EventID] <= c.kept {
						out = append(out, Event(t, binary(m, "/test")))
					}
				}
				return out
			}
			got := failures(func(t testing.TB) { CheckDuplicateBatch(t, &r, c.want, read) })
			if (len(got) != 0) != c.fails {
				t.Errorf("failures %q, want failing %v", got, c.fails)
			}
		})
	}
}

func TestInterleavedOrdersBySequenceThenAggregate(t *testing.T) {
	var got []string
	for _, m := range Interleaved(2, "order/1", "cart/9") {
		got = append(got, m.EventID)
	}
	if want := "[evt-order-1-1 evt-cart-9-1 evt-order-1-2 evt-cart-9-2]"; fmt.Sprint(got) != want {
		t.Errorf("Interleaved = %v, want %s", got, want)
	}
}
