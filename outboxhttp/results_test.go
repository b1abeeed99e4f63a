package outboxhttp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/internal/outboxtest/brokertest"
	"github.com/gorm-outbox/outbox/outboxhttp"
)

// result is one entry of the protocol's results, written here as a
// receiver that is not built on the inbox would: a plain JSON object.
type result map[string]any

var (
	handled      = result{"outcome": "handled"}
	duplicate    = result{"outcome": "duplicate"}
	notAttempted = result{"outcome": "not_attempted"}
)

func failed(reason string, permanent bool) result {
	return result{"outcome": "failed", "error": reason, "permanent": permanent}
}

// resultsReceiver is a receiver not built on the inbox: it checks each
// request with DecodeRequest (limit maxBytes, 413 beyond), records the
// event ids it carried, and answers status with the protocol's results,
// written by hand: answer's for each message, "handled" for the others.
type resultsReceiver struct {
	t        *testing.T
	status   int
	maxBytes int64
	answer   func(m outbox.Message) result

	mu       sync.Mutex
	requests [][]string // event ids of each request handled, in order
	keys     []string   // Idempotency-Key of each request handled
	refused  int        // requests answered 413
}

func (rr *resultsReceiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, err := outboxhttp.DecodeRequest(r, nil, rr.maxBytes)
	if errors.Is(err, outboxhttp.ErrTooLarge) {
		rr.mu.Lock()
		rr.refused++
		rr.mu.Unlock()
		http.Error(w, err.Error(), http.StatusRequestEntityTooLarge)
		return
	}
	if err != nil {
		rr.t.Errorf("receiver: %v", err)
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var ids []string
	results := []result{}
	for _, m := range b.Messages {
		ids = append(ids, m.EventID)
		res := handled
		if rr.answer != nil {
			res = rr.answer(m)
		}
		entry := result{"event_id": m.EventID}
		for k, v := range res {
			entry[k] = v
		}
		results = append(results, entry)
	}
	rr.mu.Lock()
	rr.requests = append(rr.requests, ids)
	rr.keys = append(rr.keys, r.Header.Get(outboxhttp.HeaderIdempotencyKey))
	rr.mu.Unlock()
	body, err := json.Marshal(map[string]any{"batch_id": b.ID, "results": results})
	if err != nil {
		rr.t.Errorf("receiver: %v", err)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(rr.status)
	_, _ = w.Write(body)
}

// Requests returns the event ids of each request received, in order.
func (rr *resultsReceiver) Requests() [][]string {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	return append([][]string(nil), rr.requests...)
}

// serve starts an HTTP server for h, closed when t ends.
func serve(t *testing.T, h http.Handler) string {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv.URL
}

// msg is event seq of aggregate order/agg, with the id evt-<agg><letter>,
// and a payload of payloadBytes bytes or so.
func msg(agg string, seq int64, payloadBytes int) outbox.Message {
	id := fmt.Sprintf("evt-%s%c", agg, 'a'+rune(seq-1))
	return outbox.Message{
		EventID: id, EventType: "order.changed", AggregateType: "order", AggregateID: agg,
		Sequence: seq, IdempotencyKey: id, Attempt: 1,
		Payload: json.RawMessage(`"` + strings.Repeat("x", payloadBytes) + `"`),
	}
}

// outcomes describes each message of b by what err says of it: "accepted",
// "not attempted", "permanent: <error>" or "retry: <error>".
func outcomes(t *testing.T, b outbox.Batch, err error) map[string]string {
	t.Helper()
	var partial *outbox.PartialError
	if err != nil && !errors.As(err, &partial) {
		t.Fatalf("Publish = %v, want nil or a *PartialError", err)
	}
	out := make(map[string]string, len(b.Messages))
	for _, m := range b.Messages {
		var e error
		if partial != nil {
			e = partial.Failed[m.EventID]
		}
		switch {
		case e == nil:
			out[m.EventID] = "accepted"
		case errors.Is(e, outbox.ErrNotAttempted):
			out[m.EventID] = "not attempted"
		case outbox.IsPermanent(e):
			out[m.EventID] = "permanent: " + e.Error()
		default:
			out[m.EventID] = "retry: " + e.Error()
		}
	}
	return out
}

func TestPublishSettlesEachMessageByItsResultWhateverTheStatus(t *testing.T) {
	t.Parallel()
	b := outbox.Batch{ID: "b-1", Messages: []outbox.Message{
		msg("1", 1, 10), msg("1", 2, 10), msg("2", 1, 10), msg("3", 1, 10), msg("4", 1, 10),
	}}
	answers := map[string]result{
		"evt-1a": failed("unknown product", true),
		"evt-1b": notAttempted,
		"evt-2a": failed("stock service down", false),
		"evt-3a": duplicate,
	}
	want := map[string]string{
		"evt-1a": "permanent: unknown product", // the receiver's reason, not its body
		"evt-1b": "not attempted",
		"evt-2a": "retry: stock service down",
		"evt-3a": "accepted",
		"evt-4a": "accepted",
	}
	for _, status := range []int{http.StatusOK, http.StatusUnprocessableEntity, http.StatusServiceUnavailable} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			t.Parallel()
			rr := &resultsReceiver{t: t, status: status, answer: func(m outbox.Message) result {
				if a, ok := answers[m.EventID]; ok {
					return a
				}
				return handled
			}}
			err := newPublisher(t, serve(t, rr)).Publish(context.Background(), b)
			if got := outcomes(t, b, err); !reflect.DeepEqual(got, want) {
				t.Errorf("outcomes %v,\nwant %v", got, want)
			}
		})
	}
}

func TestPublishAcceptsEveryMessageWhenTheResultsSaySoWhateverTheStatus(t *testing.T) {
	t.Parallel()
	rr := &resultsReceiver{t: t, status: http.StatusServiceUnavailable}
	b := outbox.Batch{ID: "b-1", Messages: []outbox.Message{msg("1", 1, 10), msg("2", 1, 10)}}
	if err := newPublisher(t, serve(t, rr)).Publish(context.Background(), b); err != nil {
		t.Errorf("Publish = %v, want nil: every result says handled", err)
	}
}

func TestPublishRetriesATransientResultNoSoonerThanRetryAfter(t *testing.T) {
	t.Parallel()
	srv := statusServer(t, http.StatusServiceUnavailable, map[string]string{"Content-Type": "application/json", "Retry-After": "30"},
		`{"batch_id":"b-1","results":[{"event_id":"evt-1a","outcome":"failed","error":"busy"},{"event_id":"evt-2a","outcome":"handled"}]}`)
	b := outbox.Batch{ID: "b-1", Messages: []outbox.Message{msg("1", 1, 10), msg("2", 1, 10)}}
	err := newPublisher(t, srv.URL).Publish(context.Background(), b)
	var partial *outbox.PartialError
	if !errors.As(err, &partial) || len(partial.Failed) != 1 {
		t.Fatalf("Publish = %v, want a *PartialError naming evt-1a", err)
	}
	var rd outbox.RetryDelayer
	if e := partial.Failed["evt-1a"]; !errors.As(e, &rd) || rd.RetryDelay() != 30*time.Second {
		t.Errorf("evt-1a: %v, want an error asking for 30s (Retry-After)", e)
	}
}

func TestPublishFailsTheRequestAsAWholeWhenItsResultsDoNotDescribeIt(t *testing.T) {
	t.Parallel()
	tests := []struct{ name, body string }{
		{"a message without a result", `{"batch_id":"b-1","results":[{"event_id":"evt-1a","outcome":"handled"}]}`},
		{"a result for no message", `{"batch_id":"b-1","results":[{"event_id":"evt-1a","outcome":"handled"},{"event_id":"evt-2a","outcome":"handled"},{"event_id":"evt-9z","outcome":"handled"}]}`},
		{"two results for a message", `{"batch_id":"b-1","results":[{"event_id":"evt-1a","outcome":"handled"},{"event_id":"evt-1a","outcome":"failed"},{"event_id":"evt-2a","outcome":"handled"}]}`},
		{"an unknown outcome", `{"batch_id":"b-1","results":[{"event_id":"evt-1a","outcome":"handled"},{"event_id":"evt-2a","outcome":"maybe"}]}`},
		{"a result that is not an object", `{"batch_id":"b-1","results":["evt-1a","evt-2a"]}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := statusServer(t, http.StatusOK, map[string]string{"Content-Type": "application/json"}, tt.body)
			b := outbox.Batch{ID: "b-1", Messages: []outbox.Message{msg("1", 1, 10), msg("2", 1, 10)}}
			err := newPublisher(t, srv.URL).Publish(context.Background(), b)
			var partial *outbox.PartialError
			if err == nil || errors.As(err, &partial) || outbox.IsPermanent(err) || !strings.Contains(err.Error(), "invalid results") {
				t.Errorf("Publish = %v; want the whole batch retried for invalid results", err)
			}
		})
	}
}

func TestPublishLeavesAJSONBodyThatIsNotTheRequestsResultsToTheStatus(t *testing.T) {
	t.Parallel()
	// Bodies of a receiver that predates the results, or whose results
	// name another request: they are no results of this request.
	bodies := []struct{ name, body string }{
		{"no results", `{"status":"whatever"}`},
		{"an empty results list without a batch_id", `{"status":"ok","results":[]}`},
		{"results that are not a list", `{"results":{"accepted":2}}`},
		{"results that are not a list, with the batch_id", `{"batch_id":"b-1","results":{"evt-1a":"handled"}}`},
		{"null results, with the batch_id", `{"batch_id":"b-1","results":null}`},
		{"results of another batch", `{"batch_id":"b-other","results":[{"event_id":"evt-1a","outcome":"failed","permanent":true}]}`},
		{"not an object", `[{"event_id":"evt-1a","outcome":"handled"}]`},
	}
	statuses := []struct {
		status int
		// want is "delivered", "retry" or "permanent", for the whole batch.
		want string
	}{
		{http.StatusOK, "delivered"},
		{http.StatusServiceUnavailable, "retry"},
		{http.StatusBadRequest, "permanent"},
	}
	for _, bb := range bodies {
		for _, st := range statuses {
			t.Run(fmt.Sprintf("%s/%d", bb.name, st.status), func(t *testing.T) {
				t.Parallel()
				srv := statusServer(t, st.status, map[string]string{"Content-Type": "application/json"}, bb.body)
				b := outbox.Batch{ID: "b-1", Messages: []outbox.Message{msg("1", 1, 10), msg("2", 1, 10)}}
				err := newPublisher(t, srv.URL).Publish(context.Background(), b)
				got := "delivered"
				var se *outboxhttp.StatusError
				var partial *outbox.PartialError
				switch {
				case err == nil:
				case errors.As(err, &partial) || !errors.As(err, &se) || se.StatusCode != st.status:
					got = fmt.Sprintf("%v (not the status, for the whole batch)", err)
				case outbox.IsPermanent(err):
					got = "permanent"
				default:
					got = "retry"
				}
				if got != st.want {
					t.Errorf("Publish = %v: %s, want %s", err, got, st.want)
				}
			})
		}
	}
}

func TestPublishFillsEachRequestUpToMaxBodyBytesInTheBatchsOrder(t *testing.T) {
	t.Parallel()
	b := outbox.Batch{ID: "b-1"}
	for i := range 12 {
		b.Messages = append(b.Messages, msg(fmt.Sprint(i%3), int64(i/3+1), 200))
	}
	// One byte short of three messages: every request carries two, the
	// most that fit.
	three, err := json.Marshal(outbox.Batch{ID: b.ID, Messages: b.Messages[:3]})
	if err != nil {
		t.Fatal(err)
	}
	limit := int64(len(three) - 1)
	rr := &resultsReceiver{t: t, status: http.StatusOK, maxBytes: limit}
	if err := newPublisher(t, serve(t, rr), outboxhttp.WithMaxBodyBytes(limit)).Publish(context.Background(), b); err != nil {
		t.Fatalf("Publish = %v, want nil", err)
	}
	var want [][]string
	for i := 0; i < len(b.Messages); i += 2 {
		want = append(want, []string{b.Messages[i].EventID, b.Messages[i+1].EventID})
	}
	if got := rr.Requests(); !reflect.DeepEqual(got, want) {
		t.Errorf("received %v, want %v", got, want)
	}
	rr.mu.Lock()
	defer rr.mu.Unlock()
	if rr.refused != 0 {
		t.Errorf("%d requests refused as too large, want none", rr.refused)
	}
	// Each request has an Idempotency-Key of its own.
	if want := []string{"b-1", "b-1.2", "b-1.3", "b-1.4", "b-1.5", "b-1.6"}; !reflect.DeepEqual(rr.keys, want) {
		t.Errorf("Idempotency-Keys %v, want %v", rr.keys, want)
	}
}

func TestPublishFailsAloneAMessageTooLargeForTheReceiver(t *testing.T) {
	t.Parallel()
	// evt-2a, of aggregate 2, is too large; evt-2b comes after it.
	b := outbox.Batch{ID: "b-1", Messages: []outbox.Message{
		msg("1", 1, 100), msg("2", 1, 3000), msg("3", 1, 100), msg("1", 2, 100), msg("2", 2, 100), msg("3", 2, 100),
	}}
	tests := []struct {
		name string
		opts []outboxhttp.Option
		// wantSent lists the requests that reach the receiver's handler.
		wantSent [][]string
	}{
		// The publisher knows the limit: it never sends evt-2a.
		{"by WithMaxBodyBytes", []outboxhttp.Option{outboxhttp.WithMaxBodyBytes(2000)},
			[][]string{{"evt-1a"}, {"evt-3a", "evt-1b", "evt-3b"}}},
		// The receiver answers 413 to the batch, then to its first half
		// [1a 2a 3a], then to [2a 3a] and to 2a alone.
		{"by the receiver's 413", nil,
			[][]string{{"evt-1a"}, {"evt-3a"}, {"evt-1b", "evt-3b"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			rr := &resultsReceiver{t: t, status: http.StatusOK, maxBytes: 2000}
			err := newPublisher(t, serve(t, rr), tt.opts...).Publish(context.Background(), b)
			got := outcomes(t, b, err)
			big := got["evt-2a"]
			delete(got, "evt-2a")
			want := map[string]string{"evt-1a": "accepted", "evt-3a": "accepted", "evt-1b": "accepted", "evt-2b": "not attempted", "evt-3b": "accepted"}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("outcomes %v,\nwant %v", got, want)
			}
			var partial *outbox.PartialError
			errors.As(err, &partial)
			if !strings.HasPrefix(big, "permanent: ") || !strings.Contains(big, "too large") || !errors.Is(partial.Failed["evt-2a"], outboxhttp.ErrTooLarge) {
				t.Errorf("evt-2a: %s; want a permanent ErrTooLarge that says too large", big)
			}
			// It names the size of the request that carries it alone: its
			// 3,000-byte payload and the envelope.
			var size int
			if m := regexp.MustCompile(`(\d+) bytes on its own`).FindStringSubmatch(big); m != nil {
				size, _ = strconv.Atoi(m[1])
			}
			if size < 3000 || size > 3300 {
				t.Errorf("evt-2a: %s; want it to name its size, a little over 3000 bytes", big)
			}
			if got := rr.Requests(); !reflect.DeepEqual(got, tt.wantSent) {
				t.Errorf("receiver handled %v, want %v", got, tt.wantSent)
			}
		})
	}
}

func TestPublishSendsNoMessageBehindOneAnEarlierRequestDidNotAccept(t *testing.T) {
	t.Parallel()
	rr := &resultsReceiver{t: t, status: http.StatusOK, answer: func(m outbox.Message) result {
		if m.EventID == "evt-1a" {
			return failed("unknown product", true)
		}
		return handled
	}}
	b := outbox.Batch{ID: "b-1", Messages: []outbox.Message{msg("1", 1, 300), msg("2", 1, 300), msg("1", 2, 300), msg("2", 2, 300)}}
	// Each message goes in a request of its own.
	err := newPublisher(t, serve(t, rr), outboxhttp.WithMaxBodyBytes(700)).Publish(context.Background(), b)
	want := map[string]string{"evt-1a": "permanent: unknown product", "evt-2a": "accepted", "evt-1b": "not attempted", "evt-2b": "accepted"}
	if got := outcomes(t, b, err); !reflect.DeepEqual(got, want) {
		t.Errorf("outcomes %v,\nwant %v", got, want)
	}
	if got, want := rr.Requests(), [][]string{{"evt-1a"}, {"evt-2a"}, {"evt-2b"}}; !reflect.DeepEqual(got, want) {
		t.Errorf("receiver got %v, want %v: evt-1b never sent", got, want)
	}
}

func TestPublishSendsNoRequestAfterOneThatFailedAsAWholeAndLeavesItsMessagesNotAttempted(t *testing.T) {
	t.Parallel()
	var (
		mu sync.Mutex
		n  int
	)
	srv := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		n++
		first := n == 1
		mu.Unlock()
		if first {
			w.WriteHeader(http.StatusOK)
			return
		}
		http.Error(w, "overloaded", http.StatusServiceUnavailable)
	}))
	// Each message goes in a request of its own.
	b := outbox.Batch{ID: "b-1", Messages: []outbox.Message{msg("1", 1, 300), msg("2", 1, 300), msg("3", 1, 300), msg("2", 2, 300)}}
	err := newPublisher(t, srv, outboxhttp.WithMaxBodyBytes(700)).Publish(context.Background(), b)
	got := outcomes(t, b, err)
	want := map[string]string{
		"evt-1a": "accepted",
		"evt-2a": `retry: outboxhttp: POST ` + srv + `: status 503 Service Unavailable: "overloaded\n"`,
		"evt-3a": "not attempted",
		"evt-2b": "not attempted",
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("outcomes %v,\nwant %v", got, want)
	}
	mu.Lock()
	defer mu.Unlock()
	if n != 2 {
		t.Errorf("%d requests, want 2: nothing is sent after the 503", n)
	}
}

func TestDispatcherSendsAgainWithoutCountingAnAttemptTheMessagesNotSentAfterARequestFailedAsAWhole(t *testing.T) {
	t.Parallel()
	var (
		mu       sync.Mutex
		requests []string // the Idempotency-Key of each request
	)
	url := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		requests = append(requests, r.Header.Get(outboxhttp.HeaderIdempotencyKey))
		first := len(requests) == 1
		mu.Unlock()
		if first {
			http.Error(w, "refused", http.StatusUnprocessableEntity) // a status, no results
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	db, _ := brokertest.OpenOutbox(t)
	var events []outbox.Event
	for _, agg := range []string{"1", "2", "3"} {
		events = append(events, outbox.Event{ID: "evt-" + agg + "a", Type: "order.changed", AggregateType: "order", AggregateID: agg,
			Payload: strings.Repeat("x", 300)})
	}
	if err := outbox.Publish(db, events...); err != nil {
		t.Fatal(err)
	}
	const poll = 50 * time.Millisecond
	// Each message goes in a request of its own.
	d, err := outbox.NewDispatcher(db, newPublisher(t, url, outboxhttp.WithMaxBodyBytes(700)),
		outbox.WithLogger(outboxtest.Logger(t)), outbox.WithPollInterval(poll))
	if err != nil {
		t.Fatal(err)
	}
	rows := func() map[string]outboxtest.Record {
		rows := map[string]outboxtest.Record{}
		for _, r := range outboxtest.Records(t, db, outbox.DefaultTable) {
			rows[r.EventID] = r
		}
		return rows
	}

	if _, err := d.DispatchOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	refused := fmt.Sprintf("failed/1: permanent: outboxhttp: POST %s: status 422 Unprocessable Entity: %q", url, "refused\n")
	// Only the refused request's message is dead-lettered; the others
	// were never sent.
	checkRows(t, rows(), map[string]string{"evt-1a": refused, "evt-2a": "pending/0", "evt-3a": "pending/0"})

	// They are due again after the poll interval, and delivered.
	time.Sleep(poll)
	brokertest.Drain(t, d)
	checkRows(t, rows(), map[string]string{"evt-1a": refused, "evt-2a": "delivered/1", "evt-3a": "delivered/1"})
	mu.Lock()
	defer mu.Unlock()
	if len(requests) != 3 {
		t.Errorf("requests %q, want 3: evt-1a's, then evt-2a's and evt-3a's in the next batch", requests)
	}
}

func TestDispatcherSettlesEachMessageByTheResultsOfAReceiverNotBuiltOnTheInbox(t *testing.T) {
	t.Parallel()
	rr := &resultsReceiver{t: t, status: http.StatusOK, answer: func(m outbox.Message) result {
		switch m.EventID {
		case "evt-1a":
			return failed("unknown product", true)
		case "evt-1b":
			return notAttempted // it comes after evt-1a in its aggregate
		}
		return handled
	}}
	rows := dispatch(t, newPublisher(t, serve(t, rr)), orderEvents())
	checkRows(t, rows, map[string]string{
		"evt-1a": "failed/1: unknown product", // the consumer's reason, not the body
		"evt-1b": "pending/0",                 // held back behind its aggregate's dead letter
		"evt-2a": "delivered/1",
	})
	if got, want := rr.Requests(), [][]string{{"evt-1a", "evt-1b", "evt-2a"}}; !reflect.DeepEqual(got, want) {
		t.Errorf("receiver got %v, want %v: evt-1b is not sent again while evt-1a is dead", got, want)
	}
}

func TestDispatcherSettlesTheWholeBatchByTheStatusOfAReceiverThatAnswersOnlyAStatus(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		status int
		// contentType and body are the response's; the body is a JSON
		// document of the receiver's own, not the request's results,
		// when contentType is application/json.
		contentType, body string
		// want is the row of every message: "delivered/1", or the state
		// and attempts followed by a colon and the error's prefix, which
		// the response's status and body follow.
		want string
	}{
		{"OK", http.StatusOK, "text/plain", "", "delivered/1"},
		{"Service Unavailable", http.StatusServiceUnavailable, "text/plain", "refused\n", "retry/1: "},
		{"Unprocessable Entity", http.StatusUnprocessableEntity, "text/plain", "refused\n", "failed/1: permanent: "},
		{"OK with an empty results list of its own", http.StatusOK, "application/json", `{"status":"ok","results":[]}`, "delivered/1"},
		{"OK with results of its own", http.StatusOK, "application/json", `{"results":{"accepted":2}}`, "delivered/1"},
		{"Service Unavailable with an empty results list of its own", http.StatusServiceUnavailable, "application/json", `{"status":"busy","results":[]}`, "retry/1: "},
		{"Service Unavailable with results of its own", http.StatusServiceUnavailable, "application/json", `{"results":{"accepted":0}}`, "retry/1: "},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			url := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", tt.contentType)
				w.WriteHeader(tt.status)
				_, _ = io.WriteString(w, tt.body)
			}))
			want := tt.want
			if tt.status != http.StatusOK {
				want += fmt.Sprintf("outboxhttp: POST %s: status %d %s: %q", url, tt.status, http.StatusText(tt.status), tt.body)
			}
			// Every message, of every aggregate, shares the batch's fate.
			rows := dispatch(t, newPublisher(t, url), orderEvents())
			checkRows(t, rows, map[string]string{"evt-1a": want, "evt-1b": want, "evt-2a": want})
		})
	}
}

// orderEvents are two events of order 1 and one of order 2.
func orderEvents() []outbox.Event {
	return []outbox.Event{
		{ID: "evt-1a", Type: "order.changed", AggregateType: "order", AggregateID: "1", Payload: 1},
		{ID: "evt-1b", Type: "order.changed", AggregateType: "order", AggregateID: "1", Payload: 2},
		{ID: "evt-2a", Type: "order.changed", AggregateType: "order", AggregateID: "2", Payload: 3},
	}
}

// dispatch commits events to a fresh SQLite outbox and runs a dispatcher
// that delivers through p until a round finds nothing due; it returns the
// rows by event id.
func dispatch(t *testing.T, p outbox.Publisher, events []outbox.Event) map[string]outboxtest.Record {
	t.Helper()
	db, _ := brokertest.OpenOutbox(t)
	if err := outbox.Publish(db, events...); err != nil {
		t.Fatal(err)
	}
	d, err := outbox.NewDispatcher(db, p, outbox.WithLogger(outboxtest.Logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	brokertest.Drain(t, d)
	rows := map[string]outboxtest.Record{}
	for _, r := range outboxtest.Records(t, db, outbox.DefaultTable) {
		rows[r.EventID] = r
	}
	return rows
}

// checkRows checks each row's "state/attempts", followed by ": last_error"
// when it has one.
func checkRows(t *testing.T, rows map[string]outboxtest.Record, want map[string]string) {
	t.Helper()
	got := map[string]string{}
	for id, r := range rows {
		got[id] = fmt.Sprintf("%s/%d", r.DeliveryState, r.DeliveryAttempts)
		if r.LastError.Valid {
			got[id] += ": " + r.LastError.String
		}
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("rows:\n got %q\nwant %q", got, want)
	}
}
