package outboxotel

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/telemetry"
)

// ScopeName is the instrumentation scope of the tracer and meter.
const ScopeName = "github.com/gorm-outbox/outbox/outboxotel"

// Defaults of the options.
const (
	// DefaultMessagingSystem is the messaging.system attribute of the
	// publish spans (see [WithMessagingSystem]).
	DefaultMessagingSystem = "outbox"
	// DefaultMaxEventTypes is how many distinct event types get their own
	// event_type attribute value (see [WithMaxEventTypes]).
	DefaultMaxEventTypes = 100
	// DefaultStatsCacheFor is how long one reading of Stats serves the
	// collections of [Watch]'s gauges (see [WithStatsCacheFor]).
	DefaultStatsCacheFor = 5 * time.Second
	// DefaultStatsTimeout bounds one reading of Stats (see
	// [WithStatsTimeout]).
	DefaultStatsTimeout = 5 * time.Second
)

// OtherEventType is the event_type value of the event types beyond the
// bound of [WithMaxEventTypes].
const OtherEventType = "other"

// Option configures [Wrap] and [Watch]; each uses the options that concern
// it. An invalid value is an error wrapping [outbox.ErrInvalidOption] that
// names the option: Watch returns it, and Wrap, which has no error to
// return, panics with it.
type Option func(*config) error

type config struct {
	tp            trace.TracerProvider
	mp            metric.MeterProvider
	system        string
	destination   string
	maxEventTypes int
	cacheFor      time.Duration
	timeout       time.Duration
}

func newConfig(opts []Option) (config, error) {
	c := config{
		system:        DefaultMessagingSystem,
		maxEventTypes: DefaultMaxEventTypes,
		cacheFor:      DefaultStatsCacheFor,
		timeout:       DefaultStatsTimeout,
	}
	for _, opt := range opts {
		if err := opt(&c); err != nil {
			return c, err
		}
	}
	if c.tp == nil {
		c.tp = otel.GetTracerProvider()
	}
	if c.mp == nil {
		c.mp = otel.GetMeterProvider()
	}
	return c, nil
}

// WithTracerProvider sets where the publish spans go.
//
// Default: the global provider, otel.GetTracerProvider(), as it is when
// Wrap is called (a provider set globally later is used as well, since the
// global one delegates to it). nil means the default.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(c *config) error {
		c.tp = tp
		return nil
	}
}

// WithMeterProvider sets where the metrics go.
//
// Default: the global provider, otel.GetMeterProvider(), as for
// [WithTracerProvider]. nil means the default.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) error {
		c.mp = mp
		return nil
	}
}

// WithMessagingSystem sets the messaging.system attribute of the publish
// spans, for example "kafka", "rabbitmq" or "nats" for the publishers of
// those brokers. name must not be empty.
//
// Default: [DefaultMessagingSystem] ("outbox").
func WithMessagingSystem(name string) Option {
	return func(c *config) error {
		if name == "" {
			return fmt.Errorf("%w: WithMessagingSystem: empty name", outbox.ErrInvalidOption)
		}
		c.system = name
		return nil
	}
}

// WithDestination sets the messaging.destination.name attribute of the
// publish spans (a topic, subject, exchange or URL path), and names the
// spans "send <name>". name must not be empty.
//
// Default: no destination; the spans are named "send".
func WithDestination(name string) Option {
	return func(c *config) error {
		if name == "" {
			return fmt.Errorf("%w: WithDestination: empty name", outbox.ErrInvalidOption)
		}
		c.destination = name
		return nil
	}
}

// WithMaxEventTypes bounds the distinct values of the event_type attribute
// of outbox_published_total: the first n event types seen get their own,
// every later one is counted under [OtherEventType]. n must be at least 1.
//
// Default: [DefaultMaxEventTypes] (100).
func WithMaxEventTypes(n int) Option {
	return func(c *config) error {
		if n < 1 {
			return fmt.Errorf("%w: WithMaxEventTypes: %d is less than 1", outbox.ErrInvalidOption, n)
		}
		c.maxEventTypes = n
		return nil
	}
}

// WithStatsCacheFor sets how long one reading of [outbox.Dispatcher.Stats]
// serves the collections of [Watch]'s gauges that follow; 0 reads Stats at
// every collection. d must not be negative.
//
// Default: [DefaultStatsCacheFor] (5s).
func WithStatsCacheFor(d time.Duration) Option {
	return func(c *config) error {
		if d < 0 {
			return fmt.Errorf("%w: WithStatsCacheFor: %v is negative", outbox.ErrInvalidOption, d)
		}
		c.cacheFor = d
		return nil
	}
}

// WithStatsTimeout bounds one reading of [outbox.Dispatcher.Stats] by
// [Watch]'s gauges. d must be positive.
//
// Default: [DefaultStatsTimeout] (5s).
func WithStatsTimeout(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("%w: WithStatsTimeout: %v is not positive", outbox.ErrInvalidOption, d)
		}
		c.timeout = d
		return nil
	}
}

// propagator is the global propagator, or W3C Trace Context while the
// global one propagates nothing.
func propagator() propagation.TextMapPropagator {
	if p := otel.GetTextMapPropagator(); len(p.Fields()) > 0 {
		return p
	}
	return propagation.TraceContext{}
}

// TraceHeaders returns the trace context of ctx as headers, for
// outbox.WithContextHeaders: with the W3C propagator, "traceparent" and,
// when ctx has trace state, "tracestate" (and whatever else the global
// propagator writes, such as "baggage"). It returns nil when ctx carries
// no valid span context.
func TraceHeaders(ctx context.Context) map[string]string {
	c := propagation.MapCarrier{}
	propagator().Inject(ctx, c)
	if len(c) == 0 {
		return nil
	}
	return c
}

// publisher is what Wrap returns.
type publisher struct {
	next     outbox.Publisher
	tracer   trace.Tracer
	name     string
	attrs    []attribute.KeyValue
	counters *telemetry.ByType[*[telemetry.NumOutcomes]metric.AddOption]

	published metric.Int64Counter
	duration  metric.Float64Histogram
	batch     metric.Int64Histogram
	lag       metric.Float64Histogram
}

// Wrap returns a publisher that publishes through p under one span per
// batch, and records the publish metrics (see the package documentation).
//
// The span, named "send" (or "send <destination>", see [WithDestination]),
// is of kind producer, with the attributes messaging.system,
// messaging.operation.type "send", messaging.operation.name "send",
// messaging.batch.message_count, messaging.destination.name when set,
// messaging.message.id when the batch has one message, and outbox.batch.id.
// It has a link to the trace context stored in the headers of each message
// that has one, carrying the message's messaging.message.id. When p fails,
// the span's status is Error with p's error, and error.type says how the
// dispatcher takes it: "partial" (a *outbox.PartialError), "permanent",
// "not_attempted" or "_OTHER" (retried). p is called with the span's
// context and the batch unchanged, and its error is returned unchanged.
//
// p must not be nil. Wrap panics with an error wrapping
// [outbox.ErrInvalidOption] when p is nil or an option is invalid.
func Wrap(p outbox.Publisher, opts ...Option) outbox.Publisher {
	if p == nil {
		panic(fmt.Errorf("%w: outboxotel: Wrap: nil Publisher", outbox.ErrInvalidOption))
	}
	c, err := newConfig(opts)
	if err != nil {
		panic(fmt.Errorf("outboxotel: Wrap: %w", err))
	}
	w := &publisher{
		next:   p,
		tracer: c.tp.Tracer(ScopeName),
		name:   "send",
		attrs: []attribute.KeyValue{
			semconv.MessagingSystemKey.String(c.system),
			semconv.MessagingOperationTypeSend,
			semconv.MessagingOperationName("send"),
		},
	}
	if c.destination != "" {
		w.name = "send " + c.destination
		w.attrs = append(w.attrs, semconv.MessagingDestinationName(c.destination))
	}
	meter := c.mp.Meter(ScopeName)
	w.published = instrument(meter.Int64Counter("outbox_published_total",
		metric.WithDescription("Outbox messages handed to the publisher, by event type and outcome (accepted, retry, permanent, not_attempted)."),
		metric.WithUnit("{message}")))(noop.Int64Counter{})
	w.duration = instrument(meter.Float64Histogram("outbox_publish_duration_seconds",
		metric.WithDescription("Duration of one publish of a batch of outbox messages."),
		metric.WithUnit("s"), metric.WithExplicitBucketBoundaries(telemetry.DurationBuckets...)))(noop.Float64Histogram{})
	w.batch = instrument(meter.Int64Histogram("outbox_batch_messages",
		metric.WithDescription("Messages per published outbox batch."),
		metric.WithUnit("{message}"), metric.WithExplicitBucketBoundaries(telemetry.BatchBuckets...)))(noop.Int64Histogram{})
	w.lag = instrument(meter.Float64Histogram("outbox_commit_to_accept_seconds",
		metric.WithDescription("Time from an outbox event's occurred-at to its acceptance by the publisher."),
		metric.WithUnit("s"), metric.WithExplicitBucketBoundaries(telemetry.LagBuckets...)))(noop.Float64Histogram{})
	w.counters = telemetry.NewByType(c.maxEventTypes, func(label string) *[telemetry.NumOutcomes]metric.AddOption {
		var opts [telemetry.NumOutcomes]metric.AddOption
		for o, name := range telemetry.Outcomes {
			opts[o] = metric.WithAttributeSet(attribute.NewSet(
				attribute.String("event_type", label), attribute.String("outcome", name)))
		}
		return &opts
	})
	return w
}

// instrument returns a function that gives the instrument created, or,
// when its creation failed, hands the error to otel.Handle and gives
// fallback, so that a misconfigured meter never stops delivery.
func instrument[T any](inst T, err error) func(fallback T) T {
	return func(fallback T) T {
		if err != nil {
			otel.Handle(fmt.Errorf("outboxotel: create instrument: %w", err))
			return fallback
		}
		return inst
	}
}

// Publish implements outbox.Publisher.
func (w *publisher) Publish(ctx context.Context, b outbox.Batch) (err error) {
	prop := propagator()
	links := make([]trace.Link, 0, len(b.Messages))
	for _, m := range b.Messages {
		if len(m.Headers) == 0 {
			continue
		}
		sc := trace.SpanContextFromContext(prop.Extract(context.Background(), propagation.MapCarrier(m.Headers)))
		if sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc, Attributes: []attribute.KeyValue{semconv.MessagingMessageID(m.EventID)}})
		}
	}
	attrs := make([]attribute.KeyValue, 0, len(w.attrs)+3)
	attrs = append(attrs, w.attrs...)
	attrs = append(attrs, semconv.MessagingBatchMessageCount(len(b.Messages)), attribute.String("outbox.batch.id", b.ID))
	if len(b.Messages) == 1 {
		attrs = append(attrs, semconv.MessagingMessageID(b.Messages[0].EventID))
	}
	ctx, span := w.tracer.Start(ctx, w.name,
		trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrs...), trace.WithLinks(links...))
	start := time.Now()
	returned := false
	defer func() {
		if !returned {
			err = telemetry.ErrPublisherDidNotReturn
		}
		w.record(ctx, b, err, start)
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
			span.SetAttributes(semconv.ErrorTypeKey.String(errorType(err)))
		}
		span.End()
	}()
	err = w.next.Publish(ctx, b)
	returned = true
	return err
}

// errorType is the error.type of a failed publish: how the dispatcher
// takes the error.
func errorType(err error) string {
	var partial *outbox.PartialError
	switch {
	case errors.As(err, &partial):
		return "partial"
	case errors.Is(err, outbox.ErrNotAttempted):
		return "not_attempted"
	case outbox.IsPermanent(err):
		return "permanent"
	}
	return semconv.ErrorTypeOther.Value.AsString()
}

func (w *publisher) record(ctx context.Context, b outbox.Batch, err error, start time.Time) {
	now := time.Now()
	w.duration.Record(ctx, now.Sub(start).Seconds())
	w.batch.Record(ctx, int64(len(b.Messages)))
	outcomes := telemetry.Classify(b, err)
	// One Add per event type and outcome of the batch, not per message.
	type tally struct {
		opts *[telemetry.NumOutcomes]metric.AddOption
		n    [telemetry.NumOutcomes]int64
	}
	var buf [16]tally
	tallies := buf[:0]
	for i, m := range b.Messages {
		opts := w.counters.Get(m.EventType)
		j := slices.IndexFunc(tallies, func(t tally) bool { return t.opts == opts })
		if j < 0 {
			j = len(tallies)
			tallies = append(tallies, tally{opts: opts})
		}
		tallies[j].n[outcomes[i]]++
		if outcomes[i] == telemetry.Accepted && !m.OccurredAt.IsZero() {
			w.lag.Record(ctx, max(0, now.Sub(m.OccurredAt).Seconds()))
		}
	}
	for _, t := range tallies {
		for o, n := range t.n {
			if n > 0 {
				w.published.Add(ctx, n, t.opts[o])
			}
		}
	}
}
