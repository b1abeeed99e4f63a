package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox"
)

// hndMsg is a message of event type typ about aggregate agg ("type/id"),
// with id as its EventID.
func hndMsg(id, typ, agg string) outbox.Message {
	at, aid, _ := strings.Cut(agg, "/")
	return outbox.Message{EventID: id, EventType: typ, AggregateType: at, AggregateID: aid,
		IdempotencyKey: id, Payload: []byte(`{}`), Attempt: 1}
}

func hndBatch(msgs ...outbox.Message) outbox.Batch {
	return outbox.Batch{ID: "batch-1", Messages: msgs}
}

// hndCalls records, in order, the EventIDs that handlers were called with.
type hndCalls struct {
	mu  sync.Mutex
	ids []string
}

// handler returns a handler that records each call and returns fail(m).
func (c *hndCalls) handler(fail func(m outbox.Message) error) outbox.HandlerFunc {
	return func(_ context.Context, m outbox.Message) error {
		c.mu.Lock()
		c.ids = append(c.ids, m.EventID)
		c.mu.Unlock()
		if fail == nil {
			return nil
		}
		return fail(m)
	}
}

func (c *hndCalls) got() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.ids)
}

func newHandlersForTest(t *testing.T, opts ...outbox.HandlersOption) *outbox.Handlers {
	t.Helper()
	h, err := outbox.NewHandlers(opts...)
	mustNil(t, err)
	return h
}

// hndFailed returns the Failed map of the *PartialError that err must be.
func hndFailed(t *testing.T, err error) map[string]error {
	t.Helper()
	var pe *outbox.PartialError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish returned %v (%T), want a *PartialError", err, err)
	}
	return pe.Failed
}

func hndKeys(m map[string]error) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

func hndSameStrings(t *testing.T, what string, got, want []string) {
	t.Helper()
	if !slices.Equal(got, want) {
		t.Fatalf("%s = %q, want %q", what, got, want)
	}
}

var errHandlerBoom = errors.New("handler boom")

func TestHandlersRouteEachMessageToItsEventTypeHandler(t *testing.T) {
	t.Parallel()
	h := newHandlersForTest(t)
	seen := map[string][]outbox.Message{}
	for _, typ := range []string{"order.created", "order.paid", "note.added"} {
		mustNil(t, h.Handle(typ, func(_ context.Context, m outbox.Message) error {
			seen[typ] = append(seen[typ], m)
			return nil
		}))
	}
	b := hndBatch(
		hndMsg("e1", "order.created", "order/1"),
		hndMsg("e2", "note.added", "note/9"),
		hndMsg("e3", "order.paid", "order/1"),
		hndMsg("e4", "order.created", "order/2"),
	)
	mustNil(t, h.Publish(context.Background(), b))
	want := map[string][]outbox.Message{
		"order.created": {b.Messages[0], b.Messages[3]},
		"order.paid":    {b.Messages[2]},
		"note.added":    {b.Messages[1]},
	}
	if !reflect.DeepEqual(seen, want) {
		t.Fatalf("handlers saw %+v, want %+v", seen, want)
	}
}

func TestHandlersPublishReturnsNilWhenAllAccepted(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		batch outbox.Batch
	}{
		{"EmptyBatch", hndBatch()},
		{"OneMessage", hndBatch(hndMsg("e1", "t", "a/1"))},
		{"ManyAggregates", hndBatch(hndMsg("e1", "t", "a/1"), hndMsg("e2", "t", "a/2"), hndMsg("e3", "t", "a/1"))},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHandlersForTest(t)
			var calls hndCalls
			mustNil(t, h.Handle("t", calls.handler(nil)))
			if err := h.Publish(context.Background(), tc.batch); err != nil {
				t.Fatalf("Publish = %v, want nil", err)
			}
			want := []string{}
			for _, m := range tc.batch.Messages {
				want = append(want, m.EventID)
			}
			hndSameStrings(t, "handled", calls.got(), want)
		})
	}
}

func TestHandlersPartialErrorNamesExactlyTheFailedMessages(t *testing.T) {
	t.Parallel()
	// Every message is its own aggregate, so no failure holds back another.
	batch := hndBatch(hndMsg("e1", "t", "a/1"), hndMsg("e2", "t", "a/2"), hndMsg("e3", "t", "a/3"))
	cases := []struct {
		name string
		fail []string
	}{
		{"First", []string{"e1"}},
		{"Last", []string{"e3"}},
		{"Two", []string{"e1", "e3"}},
		{"All", []string{"e1", "e2", "e3"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHandlersForTest(t)
			errs := map[string]error{}
			for _, id := range tc.fail {
				errs[id] = fmt.Errorf("refused %s", id)
			}
			var calls hndCalls
			mustNil(t, h.Handle("t", calls.handler(func(m outbox.Message) error { return errs[m.EventID] })))
			failed := hndFailed(t, h.Publish(context.Background(), batch))
			hndSameStrings(t, "failed ids", hndKeys(failed), tc.fail)
			for id, err := range failed {
				if err != errs[id] {
					t.Errorf("failure of %s = %v, want the handler's error %v unchanged", id, err, errs[id])
				}
			}
			hndSameStrings(t, "handled", calls.got(), []string{"e1", "e2", "e3"})
		})
	}
}

func TestHandlersHoldBackLaterMessagesOfAFailedAggregateOnly(t *testing.T) {
	t.Parallel()
	h := newHandlersForTest(t)
	var calls hndCalls
	mustNil(t, h.Handle("t", calls.handler(func(m outbox.Message) error {
		if m.EventID == "a1" {
			return errHandlerBoom
		}
		return nil
	})))
	failed := hndFailed(t, h.Publish(context.Background(), hndBatch(
		hndMsg("a1", "t", "order/1"),
		hndMsg("b1", "t", "order/2"),
		hndMsg("a2", "t", "order/1"),
		hndMsg("c1", "t", "invoice/1"), // same id, other aggregate type
		hndMsg("b2", "t", "order/2"),
		hndMsg("a3", "t", "order/1"),
	)))
	hndSameStrings(t, "handled", calls.got(), []string{"a1", "b1", "c1", "b2"})
	hndSameStrings(t, "failed ids", hndKeys(failed), []string{"a1", "a2", "a3"})
	if !errors.Is(failed["a1"], errHandlerBoom) {
		t.Errorf("a1 failed with %v, want the handler's error", failed["a1"])
	}
	for _, id := range []string{"a2", "a3"} {
		if err := failed[id]; !errors.Is(err, outbox.ErrNotAttempted) || outbox.IsPermanent(err) {
			t.Errorf("%s failed with %v, want ErrNotAttempted and not permanent", id, err)
		}
	}
}

func TestHandlersKeepWhetherAHandlerErrorIsPermanent(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name      string
		err       error
		permanent bool
	}{
		{"Plain", errHandlerBoom, false},
		{"Wrapped", fmt.Errorf("calling billing: %w", errHandlerBoom), false},
		{"Permanent", outbox.Permanent(errHandlerBoom), true},
		{"WrappedPermanent", fmt.Errorf("validating: %w", outbox.Permanent(errHandlerBoom)), true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHandlersForTest(t)
			mustNil(t, h.Handle("t", func(context.Context, outbox.Message) error { return tc.err }))
			failed := hndFailed(t, h.Publish(context.Background(), hndBatch(hndMsg("e1", "t", "a/1"))))
			err := failed["e1"]
			if got := outbox.IsPermanent(err); got != tc.permanent {
				t.Errorf("IsPermanent(%v) = %v, want %v", err, got, tc.permanent)
			}
			if !errors.Is(err, errHandlerBoom) {
				t.Errorf("failure %v does not wrap the handler's cause", err)
			}
		})
	}
}

func TestHandlersRecoverAHandlerPanicAsARetryableFailure(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		panic func()
		want  string // in the error message
	}{
		{"String", func() { panic("kaboom") }, "kaboom"},
		{"Error", func() { panic(errors.New("kaput")) }, "kaput"},
		{"PermanentError", func() { panic(outbox.Permanent(errors.New("kaput"))) }, "kaput"},
		{"RuntimeError", func() {
			var m map[string]int
			m["x"] = 1
		}, "nil map"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHandlersForTest(t)
			var calls hndCalls
			mustNil(t, h.Handle("t", calls.handler(func(m outbox.Message) error {
				if m.EventID == "a1" {
					tc.panic()
				}
				return nil
			})))
			failed := hndFailed(t, h.Publish(context.Background(), hndBatch(
				hndMsg("a1", "t", "a/1"),
				hndMsg("a2", "t", "a/1"),
				hndMsg("b1", "t", "b/1"),
			)))
			hndSameStrings(t, "handled", calls.got(), []string{"a1", "b1"})
			hndSameStrings(t, "failed ids", hndKeys(failed), []string{"a1", "a2"})
			err := failed["a1"]
			if !errors.Is(err, outbox.ErrPublisherPanic) || outbox.IsPermanent(err) || errors.Is(err, outbox.ErrNotAttempted) {
				t.Errorf("a1 failed with %v, want a retryable error wrapping ErrPublisherPanic", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("a1 failed with %q, want the panic value %q in it", err, tc.want)
			}
			if !errors.Is(failed["a2"], outbox.ErrNotAttempted) {
				t.Errorf("a2 failed with %v, want ErrNotAttempted", failed["a2"])
			}
		})
	}
}

func TestHandlersFailUnhandledDeadLettersTheMessage(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		new  func(t *testing.T) *outbox.Handlers
	}{
		{"Default", func(t *testing.T) *outbox.Handlers { return newHandlersForTest(t) }},
		{"Explicit", func(t *testing.T) *outbox.Handlers {
			return newHandlersForTest(t, outbox.WithUnhandled(outbox.FailUnhandled))
		}},
		{"ZeroValue", func(*testing.T) *outbox.Handlers { return new(outbox.Handlers) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := tc.new(t)
			var calls hndCalls
			mustNil(t, h.Handle("known", calls.handler(nil)))
			failed := hndFailed(t, h.Publish(context.Background(), hndBatch(
				hndMsg("a1", "unknown.type", "a/1"),
				hndMsg("a2", "known", "a/1"),
				hndMsg("b1", "known", "b/1"),
			)))
			hndSameStrings(t, "handled", calls.got(), []string{"b1"})
			hndSameStrings(t, "failed ids", hndKeys(failed), []string{"a1", "a2"})
			err := failed["a1"]
			if !outbox.IsPermanent(err) || !errors.Is(err, outbox.ErrNoHandler) {
				t.Errorf("a1 failed with %v, want a permanent ErrNoHandler", err)
			}
			if !strings.Contains(err.Error(), `"unknown.type"`) {
				t.Errorf("a1 failed with %q, want the event type in it", err)
			}
			if !errors.Is(failed["a2"], outbox.ErrNotAttempted) {
				t.Errorf("a2 failed with %v, want ErrNotAttempted", failed["a2"])
			}
		})
	}
}

func TestHandlersSkipUnhandledAcceptsTheMessage(t *testing.T) {
	t.Parallel()
	h := newHandlersForTest(t, outbox.WithUnhandled(outbox.SkipUnhandled))
	var calls hndCalls
	mustNil(t, h.Handle("known", calls.handler(nil)))
	err := h.Publish(context.Background(), hndBatch(
		hndMsg("a1", "unknown.type", "a/1"),
		hndMsg("a2", "known", "a/1"),
	))
	if err != nil {
		t.Fatalf("Publish = %v, want nil", err)
	}
	hndSameStrings(t, "handled", calls.got(), []string{"a2"})
}

func TestHandlersDoneContextFailsTheRemainingMessages(t *testing.T) {
	t.Parallel()
	past := time.Now().Add(-time.Second)
	cases := []struct {
		name    string
		ctx     func() (context.Context, context.CancelFunc)
		stopAt  string // the handler of this event cancels the context, then accepts
		handled []string
		want    error
	}{
		{
			name: "CancelledBeforePublish",
			ctx: func() (context.Context, context.CancelFunc) {
				ctx, cancel := context.WithCancel(context.Background())
				cancel()
				return ctx, cancel
			},
			handled: []string{},
			want:    context.Canceled,
		},
		{
			name:    "DeadlinePassed",
			ctx:     func() (context.Context, context.CancelFunc) { return context.WithDeadline(context.Background(), past) },
			handled: []string{},
			want:    context.DeadlineExceeded,
		},
		{
			name:    "CancelledDuringFirstMessage",
			ctx:     func() (context.Context, context.CancelFunc) { return context.WithCancel(context.Background()) },
			stopAt:  "x1",
			handled: []string{"x1"},
			want:    context.Canceled,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := tc.ctx()
			defer cancel()
			h := newHandlersForTest(t)
			var calls hndCalls
			mustNil(t, h.Handle("t", calls.handler(func(m outbox.Message) error {
				if m.EventID == tc.stopAt {
					cancel()
				}
				return nil
			})))
			b := hndBatch(
				hndMsg("x1", "t", "x/1"),
				hndMsg("a1", "t", "a/1"),
				hndMsg("b1", "t", "b/1"),
				hndMsg("b2", "t", "b/1"),
			)
			failed := hndFailed(t, h.Publish(ctx, b))
			hndSameStrings(t, "handled", calls.got(), tc.handled)
			for _, m := range b.Messages {
				accepted := slices.Contains(tc.handled, m.EventID)
				err, isFailed := failed[m.EventID]
				switch {
				case accepted && isFailed:
					t.Errorf("%s was handled but reported failed: %v", m.EventID, err)
				case accepted:
				case m.EventID == "b2":
					// Held back behind b1, which failed first.
					if !errors.Is(err, outbox.ErrNotAttempted) {
						t.Errorf("b2 failed with %v, want ErrNotAttempted", err)
					}
				case !errors.Is(err, tc.want) || outbox.IsPermanent(err):
					t.Errorf("%s failed with %v, want retryable %v", m.EventID, err, tc.want)
				}
			}
		})
	}
}

func TestHandlersHandleRejectsInvalidRegistration(t *testing.T) {
	t.Parallel()
	ok := func(context.Context, outbox.Message) error { return nil }
	cases := []struct {
		name      string
		eventType string
		fn        outbox.HandlerFunc
	}{
		{"EmptyEventType", "", ok},
		{"NilHandler", "t", nil},
		{"Duplicate", "taken", ok},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHandlersForTest(t)
			var first hndCalls
			mustNil(t, h.Handle("taken", first.handler(nil)))
			err := h.Handle(tc.eventType, tc.fn)
			if !errors.Is(err, outbox.ErrInvalidOption) {
				t.Fatalf("Handle(%q) = %v, want ErrInvalidOption", tc.eventType, err)
			}
			// The rejected call changed nothing.
			mustNil(t, h.Publish(context.Background(), hndBatch(hndMsg("e1", "taken", "a/1"))))
			hndSameStrings(t, "first handler's calls", first.got(), []string{"e1"})
			if tc.eventType == "t" {
				err := hndFailed(t, h.Publish(context.Background(), hndBatch(hndMsg("e2", "t", "a/2"))))["e2"]
				if !errors.Is(err, outbox.ErrNoHandler) {
					t.Errorf("after a rejected Handle, t has a handler: %v", err)
				}
			}
		})
	}
}

func TestNewHandlersRejectsInvalidOptions(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		opt  outbox.HandlersOption
	}{
		{"UnknownPolicy", outbox.WithUnhandled(outbox.UnhandledPolicy(7))},
		{"NegativePolicy", outbox.WithUnhandled(outbox.UnhandledPolicy(-1))},
		{"NilOption", nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h, err := outbox.NewHandlers(tc.opt)
			if !errors.Is(err, outbox.ErrInvalidOption) || h != nil {
				t.Fatalf("NewHandlers = %v, %v; want nil, ErrInvalidOption", h, err)
			}
		})
	}
}

func TestHandlersHandlerMayRegisterAnotherHandler(t *testing.T) {
	t.Parallel()
	h := newHandlersForTest(t)
	var calls hndCalls
	mustNil(t, h.Handle("first", func(context.Context, outbox.Message) error {
		return h.Handle("second", calls.handler(nil))
	}))
	mustNil(t, h.Publish(context.Background(), hndBatch(
		hndMsg("e1", "first", "a/1"),
		hndMsg("e2", "second", "a/1"),
	)))
	hndSameStrings(t, "second handler's calls", calls.got(), []string{"e2"})
}

func TestHandlersHandleAndPublishRunConcurrently(t *testing.T) {
	t.Parallel()
	const types = 50
	h := newHandlersForTest(t)
	var calls hndCalls
	var msgs []outbox.Message
	for i := range types {
		msgs = append(msgs, hndMsg(fmt.Sprint("e", i), fmt.Sprint("t", i), fmt.Sprint("a/", i)))
	}
	b := hndBatch(msgs...)

	const publishers = 4
	var wg sync.WaitGroup
	stop := make(chan struct{})
	running := make(chan struct{}, publishers)
	for range publishers {
		wg.Go(func() {
			for i := 0; ; i++ {
				if i == 1 {
					running <- struct{}{}
				}
				select {
				case <-stop:
					return
				default:
				}
				err := h.Publish(context.Background(), b)
				if err == nil {
					continue
				}
				var pe *outbox.PartialError
				if !errors.As(err, &pe) {
					t.Errorf("Publish returned %v (%T), want a *PartialError", err, err)
					continue
				}
				for id, err := range pe.Failed {
					if !errors.Is(err, outbox.ErrNoHandler) {
						t.Errorf("%s failed with %v, want only ErrNoHandler while registering", id, err)
					}
				}
			}
		})
	}
	for range publishers {
		<-running // register while every publisher is at work
	}
	var reg sync.WaitGroup
	for i := range types {
		reg.Go(func() {
			if err := h.Handle(fmt.Sprint("t", i), calls.handler(nil)); err != nil {
				t.Errorf("Handle: %v", err)
			}
		})
	}
	reg.Wait()
	close(stop)
	wg.Wait()
	if err := h.Publish(context.Background(), b); err != nil {
		t.Fatalf("Publish after every Handle = %v, want nil", err)
	}
}
