package outboxprom

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/telemetry"
)

// Defaults of the options.
const (
	// DefaultMaxEventTypes is how many distinct event types get their own
	// event_type label (see [WithMaxEventTypes]).
	DefaultMaxEventTypes = 100
	// DefaultStatsCacheFor is how long one reading of Stats serves scrapes
	// (see [WithStatsCacheFor]).
	DefaultStatsCacheFor = 5 * time.Second
	// DefaultStatsTimeout bounds one reading of Stats (see
	// [WithStatsTimeout]).
	DefaultStatsTimeout = 5 * time.Second
)

// OtherEventType is the event_type label of the event types beyond the
// bound of [WithMaxEventTypes].
const OtherEventType = "other"

// ErrAlreadyWatching is returned by [Metrics.Watch] when the Metrics
// watches a dispatcher already.
var ErrAlreadyWatching = errors.New("outboxprom: already watching a dispatcher")

// Option configures [New]. An invalid value makes New fail with an error
// that wraps [outbox.ErrInvalidOption] and names the option.
type Option func(*config) error

type config struct {
	maxEventTypes int
	cacheFor      time.Duration
	timeout       time.Duration
}

// WithMaxEventTypes bounds the distinct values of the event_type label:
// the first n event types seen get their own, every later one is counted
// under [OtherEventType]. n must be at least 1.
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
// serves the scrapes that follow; 0 reads Stats at every scrape. d must not
// be negative.
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

// WithStatsTimeout bounds one reading of [outbox.Dispatcher.Stats]; a
// reading that takes longer fails the gauges of that scrape. d must be
// positive.
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

// Metrics holds the outbox metrics registered by [New]. It is safe for
// concurrent use; one Metrics may wrap any number of publishers, whose
// counts add up.
type Metrics struct {
	cfg       config
	published *prometheus.CounterVec
	duration  prometheus.Histogram
	batch     prometheus.Histogram
	lag       prometheus.Histogram
	counters  *telemetry.ByType[*[telemetry.NumOutcomes]prometheus.Counter]
	stats     *statsCollector
}

// New creates the outbox metrics and registers them with reg: exactly
// the metrics the package documentation lists, with no dispatcher watched
// yet (the two gauges are absent until [Metrics.Watch]). It fails when reg
// is nil or an option is invalid (wrapping [outbox.ErrInvalidOption]), or
// when reg refuses a metric, for example because one of the same name is
// registered already; then none is left registered. To expose two outboxes
// from one process, give each its own value of one label:
// New(prometheus.WrapRegistererWith(prometheus.Labels{"outbox": "orders"}, reg)).
func New(reg prometheus.Registerer, opts ...Option) (*Metrics, error) {
	if reg == nil {
		return nil, fmt.Errorf("%w: New: nil Registerer", outbox.ErrInvalidOption)
	}
	cfg := config{maxEventTypes: DefaultMaxEventTypes, cacheFor: DefaultStatsCacheFor, timeout: DefaultStatsTimeout}
	for _, opt := range opts {
		if err := opt(&cfg); err != nil {
			return nil, err
		}
	}
	m := &Metrics{
		cfg: cfg,
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_published_total",
			Help: "Outbox messages handed to the publisher, by event type and outcome (accepted, retry, permanent, not_attempted).",
		}, []string{"event_type", "outcome"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "outbox_publish_duration_seconds",
			Help:    "Duration of one publish of a batch of outbox messages.",
			Buckets: telemetry.DurationBuckets,
		}),
		batch: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "outbox_batch_messages",
			Help:    "Messages per published outbox batch.",
			Buckets: telemetry.BatchBuckets,
		}),
		lag: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "outbox_commit_to_accept_seconds",
			Help:    "Time from an outbox event's occurred-at to its acceptance by the publisher.",
			Buckets: telemetry.LagBuckets,
		}),
		stats: newStatsCollector(),
	}
	m.counters = telemetry.NewByType(cfg.maxEventTypes, func(label string) *[telemetry.NumOutcomes]prometheus.Counter {
		var cs [telemetry.NumOutcomes]prometheus.Counter
		for o, name := range telemetry.Outcomes {
			cs[o] = m.published.WithLabelValues(label, name)
		}
		return &cs
	})
	var registered []prometheus.Collector
	for _, c := range []prometheus.Collector{m.published, m.duration, m.batch, m.lag, m.stats} {
		if err := reg.Register(c); err != nil {
			for _, r := range registered {
				reg.Unregister(r)
			}
			return nil, fmt.Errorf("outboxprom: register: %w", err)
		}
		registered = append(registered, c)
	}
	return m, nil
}

// Wrap returns a publisher that publishes through p and records every
// call: its duration, its batch size, each message's outcome and, for the
// accepted ones, the time since their OccurredAt. It returns p's error
// unchanged and hands p the batch and context unchanged. A panic of p goes
// on after being counted as retry for every message, as the dispatcher
// retries such a batch. p must not be nil: Wrap(nil) panics.
func (m *Metrics) Wrap(p outbox.Publisher) outbox.Publisher {
	if p == nil {
		panic(fmt.Errorf("%w: outboxprom: Wrap: nil Publisher", outbox.ErrInvalidOption))
	}
	return outbox.PublisherFunc(func(ctx context.Context, b outbox.Batch) (err error) {
		start := time.Now()
		returned := false
		defer func() {
			if !returned {
				err = telemetry.ErrPublisherDidNotReturn
			}
			m.record(b, err, start)
		}()
		err = p.Publish(ctx, b)
		returned = true
		return err
	})
}

func (m *Metrics) record(b outbox.Batch, err error, start time.Time) {
	now := time.Now()
	m.duration.Observe(now.Sub(start).Seconds())
	m.batch.Observe(float64(len(b.Messages)))
	outcomes := telemetry.Classify(b, err)
	// One Add per event type and outcome of the batch, not per message.
	type tally struct {
		counters *[telemetry.NumOutcomes]prometheus.Counter
		n        [telemetry.NumOutcomes]int
	}
	var buf [16]tally
	tallies := buf[:0]
	for i, msg := range b.Messages {
		cs := m.counters.Get(msg.EventType)
		j := slices.IndexFunc(tallies, func(t tally) bool { return t.counters == cs })
		if j < 0 {
			j = len(tallies)
			tallies = append(tallies, tally{counters: cs})
		}
		tallies[j].n[outcomes[i]]++
		if outcomes[i] == telemetry.Accepted && !msg.OccurredAt.IsZero() {
			m.lag.Observe(max(0, now.Sub(msg.OccurredAt).Seconds()))
		}
	}
	for _, t := range tallies {
		for o, n := range t.n {
			if n > 0 {
				t.counters[o].Add(float64(n))
			}
		}
	}
}

// Watch makes the gauges outbox_messages and outbox_oldest_due_age_seconds
// report d's table at every scrape, from [outbox.Dispatcher.Stats] read at
// most once per [WithStatsCacheFor]. Any dispatcher of the table will do:
// the gauges count the table's rows, not one dispatcher's work. It fails
// with an error wrapping [outbox.ErrInvalidOption] when d is nil and with
// [ErrAlreadyWatching] when the Metrics watches one already.
func (m *Metrics) Watch(d *outbox.Dispatcher) error {
	if d == nil {
		return fmt.Errorf("%w: outboxprom: Watch: nil Dispatcher", outbox.ErrInvalidOption)
	}
	return m.stats.watch(telemetry.NewStatsCache(d, m.cfg.cacheFor, m.cfg.timeout))
}

// statsCollector reports the gauges of a watched dispatcher's Stats.
type statsCollector struct {
	messages, oldest *prometheus.Desc

	mu    sync.Mutex
	cache *telemetry.StatsCache
}

func newStatsCollector() *statsCollector {
	return &statsCollector{
		messages: prometheus.NewDesc("outbox_messages",
			"Outbox rows by delivery state (pending, delivering, retry, failed).", []string{"state"}, nil),
		oldest: prometheus.NewDesc("outbox_oldest_due_age_seconds",
			"How long the longest-waiting due outbox row has waited; 0 when none is due.", nil, nil),
	}
}

func (c *statsCollector) watch(cache *telemetry.StatsCache) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cache != nil {
		return ErrAlreadyWatching
	}
	c.cache = cache
	return nil
}

// Describe implements prometheus.Collector.
func (c *statsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.messages
	ch <- c.oldest
}

// Collect implements prometheus.Collector.
func (c *statsCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	cache := c.cache
	c.mu.Unlock()
	if cache == nil {
		return
	}
	s, err := cache.Get(context.Background())
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.messages, err)
		ch <- prometheus.NewInvalidMetric(c.oldest, err)
		return
	}
	for i, n := range telemetry.Gauges(s) {
		ch <- prometheus.MustNewConstMetric(c.messages, prometheus.GaugeValue, float64(n), telemetry.States[i])
	}
	ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, telemetry.OldestDueAge(s, time.Now()))
}
