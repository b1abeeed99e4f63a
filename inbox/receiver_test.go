package inbox_test

import (
	"bytes"
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
	"sync/atomic"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/inbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/internal/outboxtest/brokertest"
	"github.com/gorm-outbox/outbox/outboxhttp"
)

// orderBatch is a batch of two aggregates: order 1 with two events, then
// order 2 with one.
func orderBatch(id string) outbox.Batch {
	msg := func(evt, agg string, seq int64) outbox.Message {
		return outbox.Message{
			EventID: evt, EventType: "order.updated", AggregateType: "order", AggregateID: agg,
			Sequence: seq, IdempotencyKey: evt, Payload: json.RawMessage(`{}`), Attempt: 1,
		}
	}
	return outbox.Batch{ID: id, Messages: []outbox.Message{
		msg("evt-1a", "1", 1), msg("evt-1b", "1", 2), msg("evt-2a", "2", 1),
	}}
}

// shipMessage is the consumer's ApplyFunc; it fails with failWith for the
// event ids that fail names, when fail is not nil.
func shipMessage(fail map[string]error) inbox.ApplyFunc {
	return func(tx *gorm.DB, m outbox.Message) error {
		if err := fail[m.EventID]; err != nil {
			return err
		}
		return tx.Create(&Shipment{MessageID: m.EventID, Sequence: m.Sequence}).Error
	}
}

func newReceiver(t *testing.T, in *inbox.Inbox, apply inbox.ApplyFunc, opts ...inbox.ReceiverOption) *inbox.Receiver {
	t.Helper()
	opts = append([]inbox.ReceiverOption{inbox.WithLogger(outboxtest.Logger(t))}, opts...)
	r, err := inbox.NewReceiver(in, apply, opts...)
	if err != nil {
		t.Fatalf("NewReceiver: %v", err)
	}
	return r
}

// post sends b to h as an outboxhttp publisher would, unsigned, and
// returns the status and the decoded response.
func post(t *testing.T, h http.Handler, b outbox.Batch) (int, inbox.Response) {
	t.Helper()
	body, err := json.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	req := httptest.NewRequest(http.MethodPost, "/events", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(outboxhttp.HeaderIdempotencyKey, b.ID)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	var resp inbox.Response
	if ct := rec.Header().Get("Content-Type"); ct == "application/json" {
		if err := json.Unmarshal(rec.Body.Bytes(), &resp); err != nil {
			t.Fatalf("response is not JSON: %v\n%s", err, rec.Body)
		}
	}
	return rec.Code, resp
}

// outcomes lists a response's outcomes by event id, in order.
func outcomes(r inbox.Response) []string {
	var out []string
	for _, res := range r.Results {
		out = append(out, res.EventID+"="+string(res.Outcome))
	}
	return out
}

func TestReceiverAnswersOKWhenEveryMessageIsHandledOrDuplicate(t *testing.T) {
	t.Parallel()
	db, in, _ := newConsumer(t, sqliteEngine)
	r := newReceiver(t, in, shipMessage(nil))

	status, resp := post(t, r, orderBatch("b-1"))
	if want := []string{"evt-1a=handled", "evt-1b=handled", "evt-2a=handled"}; status != http.StatusOK || !reflect.DeepEqual(outcomes(resp), want) || resp.BatchID != "b-1" {
		t.Errorf("first delivery: %d %s %v; want 200 b-1 %v", status, resp.BatchID, outcomes(resp), want)
	}
	status, resp = post(t, r, orderBatch("b-2"))
	if want := []string{"evt-1a=duplicate", "evt-1b=duplicate", "evt-2a=duplicate"}; status != http.StatusOK || !reflect.DeepEqual(outcomes(resp), want) {
		t.Errorf("redelivery: %d %v; want 200 %v", status, outcomes(resp), want)
	}
	if got, want := shipments(t, db), map[string]int{"evt-1a": 1, "evt-1b": 1, "evt-2a": 1}; !reflect.DeepEqual(got, want) {
		t.Errorf("shipments %v, want %v", got, want)
	}
}

func TestReceiverAsksForARetryWhenAMessageFails(t *testing.T) {
	t.Parallel()
	db, in, _ := newConsumer(t, sqliteEngine)
	failing := newReceiver(t, in, shipMessage(map[string]error{"evt-1a": errors.New("stock service down")}))

	status, resp := post(t, failing, orderBatch("b-1"))
	// evt-1b waits behind evt-1a, its aggregate's predecessor; order 2 goes on.
	if want := []string{"evt-1a=failed", "evt-1b=not_attempted", "evt-2a=handled"}; status != http.StatusServiceUnavailable || !reflect.DeepEqual(outcomes(resp), want) {
		t.Errorf("failing delivery: %d %v; want 503 %v", status, outcomes(resp), want)
	}
	status, resp = post(t, newReceiver(t, in, shipMessage(nil)), orderBatch("b-2"))
	if want := []string{"evt-1a=handled", "evt-1b=handled", "evt-2a=duplicate"}; status != http.StatusOK || !reflect.DeepEqual(outcomes(resp), want) {
		t.Errorf("retry: %d %v; want 200 %v", status, outcomes(resp), want)
	}
	var order []string
	if err := db.Model(&Shipment{}).Order("id").Pluck("message_id", &order).Error; err != nil {
		t.Fatal(err)
	}
	if want := []string{"evt-2a", "evt-1a", "evt-1b"}; !reflect.DeepEqual(order, want) {
		t.Errorf("applied in order %v, want %v", order, want)
	}
}

func TestReceiverStatusTellsAStatusOnlyClientWhatTheBatchNeeds(t *testing.T) {
	t.Parallel()
	permanent := outbox.Permanent(errors.New("unknown product"))
	tests := []struct {
		name   string
		fail   map[string]error
		status int
	}{
		{"all handled", nil, http.StatusOK},
		{"one fails transiently", map[string]error{"evt-2a": errors.New("timeout")}, http.StatusServiceUnavailable},
		{"one fails permanently, others handled", map[string]error{"evt-2a": permanent}, http.StatusServiceUnavailable},
		{"every aggregate fails permanently", map[string]error{"evt-1a": permanent, "evt-2a": permanent}, http.StatusUnprocessableEntity},
		{"permanent and transient failures", map[string]error{"evt-1a": permanent, "evt-2a": errors.New("timeout")}, http.StatusServiceUnavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, in, _ := newConsumer(t, sqliteEngine)
			if status, _ := post(t, newReceiver(t, in, shipMessage(tt.fail)), orderBatch("b-1")); status != tt.status {
				t.Errorf("status %d, want %d", status, tt.status)
			}
		})
	}
}

func TestReceiverAnswersEachOutcomeWithTheConsumersReasonAndWhetherItIsPermanent(t *testing.T) {
	t.Parallel()
	_, in, _ := newConsumer(t, sqliteEngine)
	r := newReceiver(t, in, shipMessage(map[string]error{
		"evt-1a": outbox.Permanent(errors.New("unknown product")),
		"evt-2a": errors.New("stock service down"),
	}))
	body, err := json.Marshal(orderBatch("b-1"))
	if err != nil {
		t.Fatal(err)
	}
	req := httptest.NewRequest(http.MethodPost, "/events", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(outboxhttp.HeaderIdempotencyKey, "b-1")
	rec := httptest.NewRecorder()
	r.ServeHTTP(rec, req)

	// The body is the outboxhttp protocol's Response, in the batch's order.
	var got outboxhttp.Response
	if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil || rec.Header().Get("Content-Type") != "application/json" {
		t.Fatalf("answer %q (%s) is not a JSON outboxhttp.Response: %v", rec.Body, rec.Header().Get("Content-Type"), err)
	}
	want := outboxhttp.Response{BatchID: "b-1", Results: []outboxhttp.Result{
		{EventID: "evt-1a", Outcome: outboxhttp.Failed, Error: "permanent: unknown product", Permanent: true},
		{EventID: "evt-1b", Outcome: outboxhttp.NotAttempted, Error: "outbox: message not attempted: evt-1a of the same aggregate failed earlier in the batch"},
		{EventID: "evt-2a", Outcome: outboxhttp.Failed, Error: "stock service down"},
	}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("answer\n %+v\nwant\n %+v", got, want)
	}
}

func TestReceiverRefusesRequestsThatFailTheChecks(t *testing.T) {
	t.Parallel()
	secret := []byte("shared-secret")
	_, in, _ := newConsumer(t, sqliteEngine)
	r := newReceiver(t, in, shipMessage(nil), inbox.WithSecret(secret), inbox.WithMaxBytes(4096))
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)

	big := orderBatch("b-big")
	big.Messages[0].Payload = json.RawMessage(`"` + strings.Repeat("x", 5000) + `"`)
	tests := []struct {
		name   string
		secret []byte
		batch  outbox.Batch
		status int
	}{
		{"signed", secret, orderBatch("b-ok"), http.StatusOK},
		{"unsigned", nil, orderBatch("b-unsigned"), http.StatusUnauthorized},
		{"signed with another secret", []byte("other"), orderBatch("b-other"), http.StatusUnauthorized},
		{"too large", secret, big, http.StatusRequestEntityTooLarge},
	}
	for _, tt := range tests {
		var opts []outboxhttp.Option
		if tt.secret != nil {
			opts = append(opts, outboxhttp.WithSecret(tt.secret))
		}
		pub, err := outboxhttp.New(srv.URL, opts...)
		if err != nil {
			t.Fatal(err)
		}
		err = pub.Publish(context.Background(), tt.batch)
		var (
			se      *outboxhttp.StatusError
			partial *outbox.PartialError
		)
		switch {
		case tt.status == http.StatusOK && err != nil:
			t.Errorf("%s: Publish = %v, want nil", tt.name, err)
		case tt.status == http.StatusRequestEntityTooLarge:
			// The publisher sends the big message alone: it fails, too
			// large; the other aggregate's message goes through.
			if !errors.As(err, &partial) || !errors.Is(partial.Failed["evt-1a"], outboxhttp.ErrTooLarge) || partial.Failed["evt-2a"] != nil ||
				!strings.Contains(partial.Failed["evt-1a"].Error(), "413") {
				t.Errorf("%s: Publish = %v, want evt-1a failed alone on a 413", tt.name, err)
			}
		case tt.status != http.StatusOK && (!errors.As(err, &se) || se.StatusCode != tt.status):
			t.Errorf("%s: Publish = %v, want status %d", tt.name, err, tt.status)
		}
	}

	req := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(`{"batch_id":"b"}`))
	req.Header.Set("Content-Type", "text/plain")
	rec := httptest.NewRecorder()
	newReceiver(t, in, shipMessage(nil)).ServeHTTP(rec, req)
	if rec.Code != http.StatusBadRequest {
		t.Errorf("malformed request answered %d, want 400", rec.Code)
	}
}

func TestNewReceiverValidatesOptions(t *testing.T) {
	t.Parallel()
	_, in, _ := newConsumer(t, sqliteEngine)
	apply := shipMessage(nil)
	tests := []struct {
		name  string
		in    *inbox.Inbox
		apply inbox.ApplyFunc
		opt   inbox.ReceiverOption
		word  string
	}{
		{"nil inbox", nil, apply, nil, "Inbox"},
		{"nil apply", in, nil, nil, "ApplyFunc"},
		{"empty secret", in, apply, inbox.WithSecret(nil), "WithSecret"},
		{"zero max bytes", in, apply, inbox.WithMaxBytes(0), "WithMaxBytes"},
		{"nil logger", in, apply, inbox.WithLogger(nil), "WithLogger"},
	}
	for _, tt := range tests {
		var opts []inbox.ReceiverOption
		if tt.opt != nil {
			opts = append(opts, tt.opt)
		}
		r, err := inbox.NewReceiver(tt.in, tt.apply, opts...)
		if !errors.Is(err, outbox.ErrInvalidOption) || r != nil || !strings.Contains(err.Error(), tt.word) {
			t.Errorf("%s: NewReceiver = %v, %v; want ErrInvalidOption naming %s", tt.name, r, err, tt.word)
		}
	}
}

func TestHandleBatchStopsWhenTheContextEnds(t *testing.T) {
	t.Parallel()
	db, in, _ := newConsumer(t, sqliteEngine)
	ctx, cancel := context.WithCancel(context.Background())
	results := in.HandleBatch(ctx, orderBatch("b-1"), func(tx *gorm.DB, m outbox.Message) error {
		cancel() // the request's client went away while the first message was applied
		return shipMessage(nil)(tx, m)
	})
	// The first message's commit races the cancel; whatever became of it,
	// nothing after it is attempted.
	for _, res := range results[1:] {
		if res.Outcome != inbox.NotAttempted || !errors.Is(res.Err, outbox.ErrNotAttempted) {
			t.Errorf("%s: %s (%v), want not attempted", res.EventID, res.Outcome, res.Err)
		}
	}
	if err := results[2].Err; !errors.Is(err, context.Canceled) {
		t.Errorf("evt-2a, of another aggregate: %v, want the ended context", err)
	}
	if n := len(shipments(t, db)); n > 1 {
		t.Errorf("%d messages applied after the context ended, want at most the first", n)
	}
}

// recordRequests wraps h: it records the event ids of each batch h is
// posted, in order, and passes the request on unchanged.
type recordRequests struct {
	h        http.Handler
	mu       sync.Mutex
	requests [][]string
}

func (rr *recordRequests) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err == nil {
		var b outbox.Batch
		if json.Unmarshal(body, &b) == nil {
			var ids []string
			for _, m := range b.Messages {
				ids = append(ids, m.EventID)
			}
			rr.mu.Lock()
			rr.requests = append(rr.requests, ids)
			rr.mu.Unlock()
		}
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	rr.h.ServeHTTP(w, r)
}

func (rr *recordRequests) Requests() [][]string {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	return append([][]string(nil), rr.requests...)
}

// producer is the service whose outbox delivers to a Receiver over HTTP.
type producer struct {
	db *gorm.DB
	d  *outbox.Dispatcher
}

// newProducer opens a fresh outbox on e whose dispatcher, made with opts,
// posts to h through a real HTTP server and an outboxhttp publisher made
// with pubOpts.
func newProducer(t *testing.T, e outboxtest.Engine, h http.Handler, pubOpts []outboxhttp.Option, opts ...outbox.DispatcherOption) producer {
	t.Helper()
	db, _ := outboxtest.Open(t, e, nil)
	if err := db.Use(outbox.Plugin()); err != nil {
		t.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	pub, err := outboxhttp.New(srv.URL, pubOpts...)
	if err != nil {
		t.Fatal(err)
	}
	d, err := outbox.NewDispatcher(db, pub, append([]outbox.DispatcherOption{outbox.WithLogger(outboxtest.Logger(t))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return producer{db: db, d: d}
}

// write commits one event of order agg per id, in order.
func (p producer) write(t *testing.T, agg string, ids ...string) {
	t.Helper()
	for _, id := range ids {
		ev := outbox.Event{ID: id, Type: "order.updated", AggregateType: "order", AggregateID: agg, Payload: map[string]string{"id": id}}
		if err := outbox.Publish(p.db, ev); err != nil {
			t.Fatal(err)
		}
	}
}

// rows returns each outbox row as "state/attempts", followed by
// ": last_error" when it has one, by event id.
func (p producer) rows(t *testing.T) map[string]string {
	t.Helper()
	got := map[string]string{}
	for _, r := range outboxtest.Records(t, p.db, outbox.DefaultTable) {
		got[r.EventID] = fmt.Sprintf("%s/%d", r.DeliveryState, r.DeliveryAttempts)
		if r.LastError.Valid {
			got[r.EventID] += ": " + r.LastError.String
		}
	}
	return got
}

func checkRows(t *testing.T, got, want map[string]string) {
	t.Helper()
	if !reflect.DeepEqual(got, want) {
		t.Errorf("outbox rows:\n got %q\nwant %q", got, want)
	}
}

func TestADeadLetterHoldsBackItsOwnAggregateAndNoOtherThroughTheReceiver(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		consumer, in, _ := newConsumer(t, engine(e))
		refuse := shipMessage(map[string]error{"evt-1a": outbox.Permanent(errors.New("unknown product"))})
		p := newProducer(t, e, newReceiver(t, in, refuse), nil)

		p.write(t, "1", "evt-1a", "evt-1b")
		p.write(t, "2", "evt-2a")
		brokertest.Drain(t, p.d)
		checkRows(t, p.rows(t), map[string]string{
			"evt-1a": "failed/1: permanent: unknown product", // the consumer's reason, alone
			"evt-1b": "pending/0",                            // not attempted, behind it
			"evt-2a": "delivered/1",
		})

		// Later events: order 2's go on, order 1's wait for its dead letter.
		p.write(t, "1", "evt-1c")
		p.write(t, "2", "evt-2b")
		brokertest.Drain(t, p.d)
		checkRows(t, p.rows(t), map[string]string{
			"evt-1a": "failed/1: permanent: unknown product",
			"evt-1b": "pending/0",
			"evt-1c": "pending/0",
			"evt-2a": "delivered/1",
			"evt-2b": "delivered/1",
		})
		if got, want := shipments(t, consumer), map[string]int{"evt-2a": 1, "evt-2b": 1}; !reflect.DeepEqual(got, want) {
			t.Errorf("the consumer applied %v, want %v", got, want)
		}
	})
}

func TestATransientRefusalThroughTheReceiverRetriesOnlyThatMessage(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		consumer, in, _ := newConsumer(t, engine(e))
		var refused atomic.Bool
		apply := func(tx *gorm.DB, m outbox.Message) error {
			if m.EventID == "evt-2a" && !refused.Swap(true) {
				return errors.New("stock service down")
			}
			return shipMessage(nil)(tx, m)
		}
		rec := &recordRequests{h: newReceiver(t, in, apply)}
		now := outbox.RetryPolicyFunc(func(int, error) time.Duration { return 0 })
		p := newProducer(t, e, rec, nil, outbox.WithRetryPolicy(now))

		p.write(t, "1", "evt-1a", "evt-1b")
		p.write(t, "2", "evt-2a")
		if _, err := p.d.DispatchOnce(context.Background()); err != nil {
			t.Fatal(err)
		}
		checkRows(t, p.rows(t), map[string]string{
			"evt-1a": "delivered/1",
			"evt-1b": "delivered/1",
			"evt-2a": "retry/1: stock service down",
		})
		brokertest.Drain(t, p.d)
		checkRows(t, p.rows(t), map[string]string{"evt-1a": "delivered/1", "evt-1b": "delivered/1", "evt-2a": "delivered/2"})
		if got, want := rec.Requests(), [][]string{{"evt-1a", "evt-1b", "evt-2a"}, {"evt-2a"}}; !reflect.DeepEqual(got, want) {
			t.Errorf("the receiver got %v, want %v: only the refused message again", got, want)
		}
		checkAppliedOnce(t, consumer, "evt-1a", "evt-1b", "evt-2a")
	})
}

func TestAMessageTooLargeForTheReceiverFailsAloneAndTheRestOfItsBatchIsDelivered(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		pubOpts []outboxhttp.Option
	}{
		{"the publisher knows the receiver's limit", []outboxhttp.Option{outboxhttp.WithMaxBodyBytes(4096)}},
		{"the receiver answers 413", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			consumer, in, _ := newConsumer(t, sqliteEngine)
			p := newProducer(t, outboxtest.SQLite, newReceiver(t, in, shipMessage(nil), inbox.WithMaxBytes(4096)), tt.pubOpts)
			if err := outbox.Publish(p.db, brokertest.OversizedEvents(5000)...); err != nil {
				t.Fatal(err)
			}
			brokertest.Drain(t, p.d)

			rows := p.rows(t)
			big := rows["big"]
			delete(rows, "big")
			checkRows(t, rows, map[string]string{"after-big": "pending/0", "other": "delivered/1"})
			var size int
			if m := regexp.MustCompile(`(\d+) bytes on its own`).FindStringSubmatch(big); m != nil {
				size, _ = strconv.Atoi(m[1])
			}
			if !strings.HasPrefix(big, "failed/1: permanent: ") || !strings.Contains(big, "too large") || size < 5000 || size > 5500 {
				t.Errorf("big: %s; want failed, permanent, too large, naming its size (a little over 5000 bytes)", big)
			}
			checkAppliedOnce(t, consumer, "other")
		})
	}
}

// At the defaults, every event the outbox accepts reaches the receiver:
// a payload of outbox.DefaultMaxPayloadBytes, with its envelope, fits
// outboxhttp's and the receiver's body limit.
func TestAnEventAtTheOutboxsPayloadLimitReachesTheReceiverAtTheDefaults(t *testing.T) {
	t.Parallel()
	consumer, in, _ := newConsumer(t, sqliteEngine)
	p := newProducer(t, outboxtest.SQLite, newReceiver(t, in, shipMessage(nil)), nil)
	// A JSON string's text is its characters and two quotes.
	atLimit := strings.Repeat("x", outbox.DefaultMaxPayloadBytes-2)
	if err := outbox.Publish(p.db,
		outbox.Event{ID: "at-limit", Type: "order.changed", AggregateType: "order", AggregateID: "1", Payload: atLimit},
		outbox.Event{ID: "next", Type: "order.changed", AggregateType: "order", AggregateID: "1", Payload: 1},
	); err != nil {
		t.Fatal(err)
	}
	brokertest.Drain(t, p.d)
	checkRows(t, p.rows(t), map[string]string{"at-limit": "delivered/1", "next": "delivered/1"})
	checkAppliedOnce(t, consumer, "at-limit", "next")
}
