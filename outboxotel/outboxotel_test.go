package outboxotel_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxhttp"
	"github.com/gorm-outbox/outbox/outboxotel"
)

// openOutbox opens a fresh database on e with the plugin (storing trace
// headers) and its tables.
func openOutbox(t *testing.T, e outboxtest.Engine) *gorm.DB {
	t.Helper()
	db, _ := outboxtest.Open(t, e, nil)
	if err := db.Use(outbox.Plugin(outbox.WithContextHeaders(outboxotel.TraceHeaders))); err != nil {
		t.Fatalf("db.Use: %v", err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatalf("AutoMigrate: %v", err)
	}
	return db
}

func newDispatcher(t *testing.T, db *gorm.DB, p outbox.Publisher, opts ...outbox.DispatcherOption) *outbox.Dispatcher {
	t.Helper()
	opts = append([]outbox.DispatcherOption{outbox.WithLogger(outboxtest.Logger(t))}, opts...)
	d, err := outbox.NewDispatcher(db, p, opts...)
	if err != nil {
		t.Fatalf("NewDispatcher: %v", err)
	}
	return d
}

func newTracing() (*sdktrace.TracerProvider, *tracetest.InMemoryExporter) {
	exp := tracetest.NewInMemoryExporter()
	return sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp)), exp
}

func traceparent(sc trace.SpanContext) string {
	return fmt.Sprintf("00-%s-%s-%s", sc.TraceID(), sc.SpanID(), sc.TraceFlags())
}

func attrs(kvs []attribute.KeyValue) map[string]string {
	out := map[string]string{}
	for _, kv := range kvs {
		out[string(kv.Key)] = kv.Value.Emit()
	}
	return out
}

// TestPublishSpanLinksToTheWritersTraceThroughHTTP writes an event inside
// a span, delivers it through outboxhttp to a receiver, and checks that
// the writer's traceparent was stored, reached the receiver, and is linked
// from the publish span.
func TestPublishSpanLinksToTheWritersTraceThroughHTTP(t *testing.T) {
	for _, e := range outboxtest.Engines {
		t.Run(string(e), func(t *testing.T) {
			t.Parallel()
			db := openOutbox(t, e)
			tp, spans := newTracing()

			ctx, writer := tp.Tracer("app").Start(context.Background(), "create order")
			if err := outbox.Publish(db.WithContext(ctx), outbox.Event{Type: "order.created", AggregateType: "order", AggregateID: "42", Payload: map[string]int{"id": 42}}); err != nil {
				t.Fatalf("Publish: %v", err)
			}
			writer.End()
			want := traceparent(writer.SpanContext())
			rs := outboxtest.Records(t, db, outbox.DefaultTable)
			var stored map[string]string
			if len(rs) != 1 || json.Unmarshal([]byte(rs[0].Headers.String), &stored) != nil || stored["traceparent"] != want {
				t.Fatalf("stored headers %q, want traceparent %s", rs[0].Headers.String, want)
			}

			var (
				mu       sync.Mutex
				received []string
			)
			receiver := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				b, err := outboxhttp.DecodeRequest(r, nil, 1<<20)
				if err != nil {
					http.Error(w, err.Error(), http.StatusBadRequest)
					return
				}
				mu.Lock()
				for _, m := range b.Messages {
					received = append(received, m.Headers["traceparent"])
				}
				mu.Unlock()
				w.WriteHeader(http.StatusNoContent)
			}))
			t.Cleanup(receiver.Close)
			pub, err := outboxhttp.New(receiver.URL)
			if err != nil {
				t.Fatal(err)
			}
			d := newDispatcher(t, db, outboxotel.Wrap(pub, outboxotel.WithTracerProvider(tp), outboxotel.WithMessagingSystem("http"), outboxotel.WithDestination("orders")))
			if n, err := d.DispatchOnce(context.Background()); err != nil || n != 1 {
				t.Fatalf("DispatchOnce: %d, %v; want 1 delivered", n, err)
			}

			mu.Lock()
			got := strings.Join(received, ",")
			mu.Unlock()
			if got != want {
				t.Fatalf("receiver got traceparent %q, want %q", got, want)
			}
			var send *tracetest.SpanStub
			for _, s := range spans.GetSpans() {
				if s.Name == "send orders" {
					send = &s
				}
			}
			if send == nil {
				t.Fatalf("no span named %q among %v", "send orders", spans.GetSpans())
			}
			if send.SpanKind != trace.SpanKindProducer {
				t.Errorf("span kind %v, want producer", send.SpanKind)
			}
			if send.Parent.IsValid() || send.SpanContext.TraceID() == writer.SpanContext().TraceID() {
				t.Errorf("publish span has parent %v in trace %v; want a root span of its own trace", send.Parent, send.SpanContext.TraceID())
			}
			if len(send.Links) != 1 || !send.Links[0].SpanContext.Equal(writer.SpanContext().WithRemote(true)) {
				t.Fatalf("links %+v, want one to the writer's span %v", send.Links, writer.SpanContext())
			}
			if id := attrs(send.Links[0].Attributes)["messaging.message.id"]; id != rs[0].EventID {
				t.Errorf("link's messaging.message.id %q, want %q", id, rs[0].EventID)
			}
		})
	}
}

func TestPublishSpanFollowsTheMessagingConventions(t *testing.T) {
	one := []outbox.Message{{EventID: "e1", EventType: "t", AggregateType: "a", AggregateID: "1"}}
	two := append(one, outbox.Message{EventID: "e2", EventType: "t", AggregateType: "a", AggregateID: "2"})
	cases := []struct {
		name      string
		messages  []outbox.Message
		err       error
		want      map[string]string // attributes that must be present
		absent    []string
		status    codes.Code
		errorType string
	}{
		{
			name: "one message accepted", messages: one,
			want: map[string]string{
				"messaging.system": "outbox", "messaging.operation.type": "send", "messaging.operation.name": "send",
				"messaging.batch.message_count": "1", "messaging.message.id": "e1", "outbox.batch.id": "b1",
			},
			absent: []string{"error.type", "messaging.destination.name"},
			status: codes.Unset,
		},
		{
			name: "batch accepted", messages: two,
			want:   map[string]string{"messaging.batch.message_count": "2"},
			absent: []string{"messaging.message.id", "error.type"},
			status: codes.Unset,
		},
		{name: "retryable failure", messages: two, err: errors.New("down"), status: codes.Error, errorType: "_OTHER"},
		{name: "permanent failure", messages: two, err: outbox.Permanent(errors.New("bad")), status: codes.Error, errorType: "permanent"},
		{name: "not attempted", messages: two, err: outbox.ErrNotAttempted, status: codes.Error, errorType: "not_attempted"},
		{
			name: "partly accepted", messages: two,
			err:    &outbox.PartialError{Failed: map[string]error{"e2": outbox.Permanent(errors.New("bad"))}},
			status: codes.Error, errorType: "partial",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tp, spans := newTracing()
			var inner trace.SpanContext
			p := outboxotel.Wrap(outbox.PublisherFunc(func(ctx context.Context, b outbox.Batch) error {
				inner = trace.SpanContextFromContext(ctx)
				return tc.err
			}), outboxotel.WithTracerProvider(tp))
			if err := p.Publish(context.Background(), outbox.Batch{ID: "b1", Messages: tc.messages}); err != tc.err {
				t.Fatalf("Publish: %v, want the inner error %v unchanged", err, tc.err)
			}
			got := spans.GetSpans()
			if len(got) != 1 {
				t.Fatalf("%d spans, want 1", len(got))
			}
			s := got[0]
			if s.Name != "send" || s.SpanKind != trace.SpanKindProducer {
				t.Errorf("span %q of kind %v, want \"send\", producer", s.Name, s.SpanKind)
			}
			if !inner.Equal(s.SpanContext) {
				t.Errorf("inner publisher ran in span %v, want the publish span %v", inner, s.SpanContext)
			}
			a := attrs(s.Attributes)
			for k, v := range tc.want {
				if a[k] != v {
					t.Errorf("attribute %s = %q, want %q", k, a[k], v)
				}
			}
			for _, k := range tc.absent {
				if _, ok := a[k]; ok {
					t.Errorf("attribute %s = %q, want none", k, a[k])
				}
			}
			if s.Status.Code != tc.status || (tc.err != nil && s.Status.Description != tc.err.Error()) {
				t.Errorf("status %v %q, want %v %q", s.Status.Code, s.Status.Description, tc.status, tc.err)
			}
			if tc.errorType != "" && a["error.type"] != tc.errorType {
				t.Errorf("error.type = %q, want %q", a["error.type"], tc.errorType)
			}
		})
	}
}

func TestWrapHandsTheStoredTraceContextOnUnchanged(t *testing.T) {
	tp, _ := newTracing()
	headers := map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant": "acme"}
	var got map[string]string
	p := outboxotel.Wrap(outbox.PublisherFunc(func(_ context.Context, b outbox.Batch) error {
		got = b.Messages[0].Headers
		return nil
	}), outboxotel.WithTracerProvider(tp))
	if err := p.Publish(context.Background(), outbox.Batch{ID: "b", Messages: []outbox.Message{{EventID: "e", Headers: headers}}}); err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got["traceparent"] != headers["traceparent"] || got["tenant"] != "acme" {
		t.Fatalf("inner publisher got headers %v, want %v", got, headers)
	}
}

func TestTraceHeadersOfAContextWithoutSpanIsNil(t *testing.T) {
	if h := outboxotel.TraceHeaders(context.Background()); h != nil {
		t.Fatalf("TraceHeaders = %v, want nil", h)
	}
}

func TestTraceHeadersCarryTraceState(t *testing.T) {
	ts, err := trace.ParseTraceState("vendor=value")
	if err != nil {
		t.Fatal(err)
	}
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled, TraceState: ts,
	})
	h := outboxotel.TraceHeaders(trace.ContextWithSpanContext(context.Background(), sc))
	if h["traceparent"] != traceparent(sc) || h["tracestate"] != "vendor=value" {
		t.Fatalf("TraceHeaders = %v", h)
	}
}

func TestWrapPanicsOnBadInput(t *testing.T) {
	ok := outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil })
	cases := []struct {
		name string
		p    outbox.Publisher
		opt  outboxotel.Option
		want string
	}{
		{"nil publisher", nil, nil, "nil Publisher"},
		{"empty messaging system", ok, outboxotel.WithMessagingSystem(""), "WithMessagingSystem"},
		{"empty destination", ok, outboxotel.WithDestination(""), "WithDestination"},
		{"no event types", ok, outboxotel.WithMaxEventTypes(0), "WithMaxEventTypes"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			defer func() {
				err, _ := recover().(error)
				if !errors.Is(err, outbox.ErrInvalidOption) || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("Wrap panicked with %v, want an ErrInvalidOption naming %s", err, tc.want)
				}
			}()
			var opts []outboxotel.Option
			if tc.opt != nil {
				opts = append(opts, tc.opt)
			}
			outboxotel.Wrap(tc.p, opts...)
		})
	}
}

func TestWatchRejectsBadInput(t *testing.T) {
	db := openOutbox(t, outboxtest.SQLite)
	d := newDispatcher(t, db, outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil }))
	for name, call := range map[string]func() error{
		"nil dispatcher":    func() error { _, err := outboxotel.Watch(nil); return err },
		"WithStatsCacheFor": func() error { _, err := outboxotel.Watch(d, outboxotel.WithStatsCacheFor(-1)); return err },
		"WithStatsTimeout":  func() error { _, err := outboxotel.Watch(d, outboxotel.WithStatsTimeout(0)); return err },
	} {
		if err := call(); !errors.Is(err, outbox.ErrInvalidOption) {
			t.Errorf("%s: %v, want ErrInvalidOption", name, err)
		}
	}
}

// collect reads every metric of reader by name.
func collect(t *testing.T, reader *sdkmetric.ManualReader) map[string]metricdata.Aggregation {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatalf("Collect: %v", err)
	}
	out := map[string]metricdata.Aggregation{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			out[m.Name] = m.Data
		}
	}
	return out
}

func key(set attribute.Set, names ...string) string {
	var parts []string
	for _, n := range names {
		v, _ := set.Value(attribute.Key(n))
		parts = append(parts, v.Emit())
	}
	return strings.Join(parts, "/")
}

func TestOTelMetricsAfterDispatch(t *testing.T) {
	for _, e := range outboxtest.Engines {
		t.Run(string(e), func(t *testing.T) {
			t.Parallel()
			db := openOutbox(t, e)
			for _, id := range []string{"a", "a", "b", "c"} {
				if err := outbox.Publish(db, outbox.Event{Type: "order.created", AggregateType: "order", AggregateID: id}); err != nil {
					t.Fatal(err)
				}
			}
			reader := sdkmetric.NewManualReader()
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
			// a#1 is retried, a#2 (accepted after it) goes back as not
			// attempted, b is dead-lettered by the publisher, c accepted.
			p := outboxotel.Wrap(outbox.PublisherFunc(func(_ context.Context, b outbox.Batch) error {
				failed := map[string]error{}
				for _, m := range b.Messages {
					switch {
					case m.AggregateID == "a" && m.Sequence == 1:
						failed[m.EventID] = errors.New("timeout")
					case m.AggregateID == "b":
						failed[m.EventID] = outbox.Permanent(errors.New("rejected"))
					}
				}
				return &outbox.PartialError{Failed: failed}
			}), outboxotel.WithMeterProvider(mp), outboxotel.WithTracerProvider(tracenoop.NewTracerProvider()))
			d := newDispatcher(t, db, p)
			reg, err := outboxotel.Watch(d, outboxotel.WithMeterProvider(mp), outboxotel.WithStatsCacheFor(0))
			if err != nil {
				t.Fatalf("Watch: %v", err)
			}
			defer reg.Unregister()
			if _, err := d.DispatchOnce(context.Background()); err != nil {
				t.Fatalf("DispatchOnce: %v", err)
			}
			data := collect(t, reader)

			counts := map[string]int64{}
			for _, dp := range data["outbox_published_total"].(metricdata.Sum[int64]).DataPoints {
				counts[key(dp.Attributes, "event_type", "outcome")] = dp.Value
			}
			wantCounts := map[string]int64{"order.created/retry": 1, "order.created/not_attempted": 1, "order.created/permanent": 1, "order.created/accepted": 1}
			if fmt.Sprint(counts) != fmt.Sprint(wantCounts) {
				t.Errorf("outbox_published_total = %v, want %v", counts, wantCounts)
			}
			if h := data["outbox_batch_messages"].(metricdata.Histogram[int64]).DataPoints; len(h) != 1 || h[0].Count != 1 || h[0].Sum != 4 {
				t.Errorf("outbox_batch_messages = %+v, want one batch of 4", h)
			}
			if h := data["outbox_publish_duration_seconds"].(metricdata.Histogram[float64]).DataPoints; len(h) != 1 || h[0].Count != 1 {
				t.Errorf("outbox_publish_duration_seconds = %+v, want one sample", h)
			}
			if h := data["outbox_commit_to_accept_seconds"].(metricdata.Histogram[float64]).DataPoints; len(h) != 1 || h[0].Count != 1 {
				t.Errorf("outbox_commit_to_accept_seconds = %+v, want one sample (c)", h)
			}
			states := map[string]int64{}
			for _, dp := range data["outbox_messages"].(metricdata.Gauge[int64]).DataPoints {
				states[key(dp.Attributes, "state")] = dp.Value
			}
			wantStates := map[string]int64{"pending": 1, "delivering": 0, "retry": 1, "failed": 1}
			if fmt.Sprint(states) != fmt.Sprint(wantStates) {
				t.Errorf("outbox_messages = %v, want %v", states, wantStates)
			}
			// a#1 waits for its backoff, a#2 behind it: nothing is due.
			if g := data["outbox_oldest_due_age_seconds"].(metricdata.Gauge[float64]).DataPoints; len(g) != 1 || g[0].Value < 0 {
				t.Errorf("outbox_oldest_due_age_seconds = %+v, want one point", g)
			}
		})
	}
}
