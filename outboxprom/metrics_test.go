package outboxprom_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxprom"
)

// openOutbox opens a fresh database on e with the plugin and its tables.
func openOutbox(t *testing.T, e outboxtest.Engine) *gorm.DB {
	t.Helper()
	db, _ := outboxtest.Open(t, e, nil)
	if err := db.Use(outbox.Plugin()); err != nil {
		t.Fatalf("db.Use: %v", err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatalf("AutoMigrate: %v", err)
	}
	return db
}

// write records one event per aggregate id, of type typ.
func write(t *testing.T, db *gorm.DB, typ string, aggregates ...string) {
	t.Helper()
	for _, id := range aggregates {
		if err := outbox.Publish(db, outbox.Event{Type: typ, AggregateType: "order", AggregateID: id, Payload: map[string]string{"id": id}}); err != nil {
			t.Fatalf("Publish: %v", err)
		}
	}
}

func newMetrics(t *testing.T, opts ...outboxprom.Option) (*outboxprom.Metrics, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	m, err := outboxprom.New(reg, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return m, reg
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

// scrape gathers reg and returns its families by name.
func scrape(t *testing.T, reg prometheus.Gatherer) map[string]*dto.MetricFamily {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("Gather: %v", err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		out[mf.GetName()] = mf
	}
	return out
}

// series returns the metric of family name whose labels are exactly
// labels ("k=v" pairs), or nil.
func series(mfs map[string]*dto.MetricFamily, name string, labels ...string) *dto.Metric {
	for _, m := range mfs[name].GetMetric() {
		var got []string
		for _, l := range m.GetLabel() {
			got = append(got, l.GetName()+"="+l.GetValue())
		}
		if strings.Join(got, ",") == strings.Join(labels, ",") {
			return m
		}
	}
	return nil
}

// published returns the outbox_published_total series as "type/outcome"
// to value, leaving out zeros.
func published(mfs map[string]*dto.MetricFamily) map[string]float64 {
	out := map[string]float64{}
	for _, m := range mfs["outbox_published_total"].GetMetric() {
		var typ, outcome string
		for _, l := range m.GetLabel() {
			switch l.GetName() {
			case "event_type":
				typ = l.GetValue()
			case "outcome":
				outcome = l.GetValue()
			}
		}
		if v := m.GetCounter().GetValue(); v != 0 {
			out[typ+"/"+outcome] = v
		}
	}
	return out
}

func gauges(mfs map[string]*dto.MetricFamily) map[string]float64 {
	out := map[string]float64{}
	for _, state := range []string{"pending", "delivering", "retry", "failed"} {
		out[state] = series(mfs, "outbox_messages", "state="+state).GetGauge().GetValue()
	}
	return out
}

func histogramCount(mfs map[string]*dto.MetricFamily, name string) uint64 {
	return series(mfs, name).GetHistogram().GetSampleCount()
}

func equal(a, b map[string]float64) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

var errBroker = errors.New("broker unavailable")

// TestMetricsAfterDispatch dispatches one batch of five messages (two of
// aggregate a, one each of b, c, d) through publishers that answer in
// different ways, and checks every metric against what the dispatcher did.
func TestMetricsAfterDispatch(t *testing.T) {
	cases := []struct {
		name        string
		maxAttempts int
		publish     func(b outbox.Batch) error
		published   map[string]float64
		states      map[string]float64
		accepted    uint64
	}{
		{
			name:      "all accepted",
			publish:   func(outbox.Batch) error { return nil },
			published: map[string]float64{"order.created/accepted": 5},
			states:    map[string]float64{"pending": 0, "delivering": 0, "retry": 0, "failed": 0},
			accepted:  5,
		},
		{
			name:      "retryable failure",
			publish:   func(outbox.Batch) error { return errBroker },
			published: map[string]float64{"order.created/retry": 5},
			states:    map[string]float64{"pending": 0, "delivering": 0, "retry": 5, "failed": 0},
		},
		{
			name:        "out of attempts",
			maxAttempts: 1,
			publish:     func(outbox.Batch) error { return errBroker },
			published:   map[string]float64{"order.created/retry": 5},
			states:      map[string]float64{"pending": 0, "delivering": 0, "retry": 0, "failed": 5},
		},
		{
			name:      "permanent failure",
			publish:   func(outbox.Batch) error { return fmt.Errorf("wrapped: %w", outbox.Permanent(errBroker)) },
			published: map[string]float64{"order.created/permanent": 5},
			states:    map[string]float64{"pending": 0, "delivering": 0, "retry": 0, "failed": 5},
		},
		{
			name:      "not attempted",
			publish:   func(outbox.Batch) error { return outbox.ErrNotAttempted },
			published: map[string]float64{"order.created/not_attempted": 5},
			states:    map[string]float64{"pending": 5, "delivering": 0, "retry": 0, "failed": 0},
		},
		{
			// a#1 fails (retry), a#2 is accepted after it (settled as not
			// attempted, back to pending), b is declined (pending), c is
			// dead-lettered, d accepted.
			name: "partly accepted",
			publish: func(b outbox.Batch) error {
				failed := map[string]error{}
				for _, m := range b.Messages {
					switch {
					case m.AggregateID == "a" && m.Sequence == 1:
						failed[m.EventID] = errBroker
					case m.AggregateID == "b":
						failed[m.EventID] = outbox.ErrNotAttempted
					case m.AggregateID == "c":
						failed[m.EventID] = outbox.Permanent(errBroker)
					}
				}
				return fmt.Errorf("gateway: %w", &outbox.PartialError{Failed: failed})
			},
			published: map[string]float64{"order.created/retry": 1, "order.created/not_attempted": 2, "order.created/permanent": 1, "order.created/accepted": 1},
			states:    map[string]float64{"pending": 2, "delivering": 0, "retry": 1, "failed": 1},
			accepted:  1,
		},
	}
	for _, e := range outboxtest.Engines {
		for _, tc := range cases {
			t.Run(string(e)+"/"+tc.name, func(t *testing.T) {
				t.Parallel()
				db := openOutbox(t, e)
				write(t, db, "order.created", "a", "a", "b", "c", "d")
				m, reg := newMetrics(t, outboxprom.WithStatsCacheFor(0))
				var opts []outbox.DispatcherOption
				if tc.maxAttempts > 0 {
					opts = append(opts, outbox.WithMaxAttempts(tc.maxAttempts))
				}
				d := newDispatcher(t, db, m.Wrap(outbox.PublisherFunc(func(_ context.Context, b outbox.Batch) error {
					return tc.publish(b)
				})), opts...)
				if err := m.Watch(d); err != nil {
					t.Fatalf("Watch: %v", err)
				}
				if _, err := d.DispatchOnce(context.Background()); err != nil {
					t.Fatalf("DispatchOnce: %v", err)
				}
				mfs := scrape(t, reg)
				if got := published(mfs); !equal(got, tc.published) {
					t.Errorf("outbox_published_total = %v, want %v", got, tc.published)
				}
				if got := gauges(mfs); !equal(got, tc.states) {
					t.Errorf("outbox_messages = %v, want %v", got, tc.states)
				}
				if n := histogramCount(mfs, "outbox_publish_duration_seconds"); n != 1 {
					t.Errorf("outbox_publish_duration_seconds has %d samples, want 1 (one batch)", n)
				}
				if h := series(mfs, "outbox_batch_messages").GetHistogram(); h.GetSampleCount() != 1 || h.GetSampleSum() != 5 {
					t.Errorf("outbox_batch_messages: %d samples summing to %v, want 1 batch of 5", h.GetSampleCount(), h.GetSampleSum())
				}
				if n := histogramCount(mfs, "outbox_commit_to_accept_seconds"); n != tc.accepted {
					t.Errorf("outbox_commit_to_accept_seconds has %d samples, want %d (one per accepted message)", n, tc.accepted)
				}
			})
		}
	}
}

func TestOldestDueAgeIsTheWaitOfTheOldestDueRow(t *testing.T) {
	for _, e := range outboxtest.Engines {
		t.Run(string(e), func(t *testing.T) {
			t.Parallel()
			db := openOutbox(t, e)
			m, reg := newMetrics(t, outboxprom.WithStatsCacheFor(0))
			d := newDispatcher(t, db, m.Wrap(outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil })))
			if err := m.Watch(d); err != nil {
				t.Fatalf("Watch: %v", err)
			}
			age := func() float64 {
				return series(scrape(t, reg), "outbox_oldest_due_age_seconds").GetGauge().GetValue()
			}
			if a := age(); a != 0 {
				t.Fatalf("empty outbox: age %v, want 0", a)
			}
			before := time.Now()
			write(t, db, "order.created", "a")
			time.Sleep(300 * time.Millisecond)
			a := age()
			if bound := time.Since(before).Seconds() + 0.05; a < 0.25 || a > bound {
				t.Fatalf("one row due for 300ms: age %v, want between 0.25 and %v", a, bound)
			}
			if _, err := d.DispatchOnce(context.Background()); err != nil {
				t.Fatalf("DispatchOnce: %v", err)
			}
			if a := age(); a != 0 {
				t.Fatalf("everything delivered: age %v, want 0", a)
			}
		})
	}
}

func TestScrapesWithinTheCacheIntervalReuseOneStats(t *testing.T) {
	db := openOutbox(t, outboxtest.SQLite)
	m, reg := newMetrics(t, outboxprom.WithStatsCacheFor(time.Hour))
	d := newDispatcher(t, db, m.Wrap(outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil })))
	if err := m.Watch(d); err != nil {
		t.Fatalf("Watch: %v", err)
	}
	write(t, db, "order.created", "a")
	if n := gauges(scrape(t, reg))["pending"]; n != 1 {
		t.Fatalf("pending = %v, want 1", n)
	}
	write(t, db, "order.created", "b")
	if n := gauges(scrape(t, reg))["pending"]; n != 1 {
		t.Fatalf("pending = %v within the cache interval, want the cached 1", n)
	}

	m2, reg2 := newMetrics(t, outboxprom.WithStatsCacheFor(0))
	if err := m2.Watch(d); err != nil {
		t.Fatalf("Watch: %v", err)
	}
	if n := gauges(scrape(t, reg2))["pending"]; n != 2 {
		t.Fatalf("pending = %v without a cache, want 2", n)
	}
}

func TestFailingStatsFailsOnlyTheGauges(t *testing.T) {
	db := openOutbox(t, outboxtest.SQLite)
	m, reg := newMetrics(t, outboxprom.WithStatsCacheFor(0))
	d := newDispatcher(t, db, m.Wrap(outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil })))
	if err := m.Watch(d); err != nil {
		t.Fatalf("Watch: %v", err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		t.Fatal(err)
	}
	sqlDB.Close()
	mfs, err := reg.Gather()
	if err == nil || !strings.Contains(err.Error(), "outbox: stats") {
		t.Fatalf("Gather with the database closed: %v, want the Stats error", err)
	}
	// What a handler with ContinueOnError serves: the other metrics.
	var names []string
	for _, mf := range mfs {
		names = append(names, mf.GetName())
	}
	if got, want := strings.Join(names, " "), "outbox_batch_messages outbox_commit_to_accept_seconds outbox_publish_duration_seconds"; got != want {
		t.Fatalf("gathered %s, want %s", got, want)
	}
}

func TestEventTypesBeyondTheBoundAreCountedAsOther(t *testing.T) {
	m, reg := newMetrics(t, outboxprom.WithMaxEventTypes(2))
	p := m.Wrap(outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil }))
	var msgs []outbox.Message
	for _, typ := range []string{"t1", "t2", "t3", "t4", "t1", "t3"} {
		msgs = append(msgs, outbox.Message{EventID: typ, EventType: typ, AggregateType: "x", AggregateID: typ})
	}
	if err := p.Publish(context.Background(), outbox.Batch{ID: "b", Messages: msgs}); err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{"t1/accepted": 2, "t2/accepted": 1, outboxprom.OtherEventType + "/accepted": 3}
	if got := published(scrape(t, reg)); !equal(got, want) {
		t.Fatalf("outbox_published_total = %v, want %v", got, want)
	}
}

func TestPanickingPublisherCountsRetryAndPanicsOn(t *testing.T) {
	m, reg := newMetrics(t)
	p := m.Wrap(outbox.PublisherFunc(func(context.Context, outbox.Batch) error { panic("boom") }))
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Fatalf("recovered %v, want the publisher's panic", r)
			}
		}()
		_ = p.Publish(context.Background(), outbox.Batch{ID: "b", Messages: []outbox.Message{{EventID: "1", EventType: "t"}}})
	}()
	if got, want := published(scrape(t, reg)), map[string]float64{"t/retry": 1}; !equal(got, want) {
		t.Fatalf("outbox_published_total = %v, want %v", got, want)
	}
}

func TestWrapReturnsTheInnerErrorAndBatchUnchanged(t *testing.T) {
	m, _ := newMetrics(t)
	in := outbox.Batch{ID: "b", Messages: []outbox.Message{{EventID: "1", EventType: "t", Headers: map[string]string{"traceparent": "x"}}}}
	var got outbox.Batch
	p := m.Wrap(outbox.PublisherFunc(func(_ context.Context, b outbox.Batch) error { got = b; return errBroker }))
	if err := p.Publish(context.Background(), in); err != errBroker {
		t.Fatalf("Publish: %v, want the inner error itself", err)
	}
	if got.ID != "b" || len(got.Messages) != 1 || got.Messages[0].Headers["traceparent"] != "x" {
		t.Fatalf("inner publisher got %+v", got)
	}
}

func TestNewRegistersExactlyTheDocumentedMetrics(t *testing.T) {
	db := openOutbox(t, outboxtest.SQLite)
	write(t, db, "order.created", "a")
	m, reg := newMetrics(t)
	d := newDispatcher(t, db, m.Wrap(outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil })))
	if err := m.Watch(d); err != nil {
		t.Fatalf("Watch: %v", err)
	}
	if _, err := d.DispatchOnce(context.Background()); err != nil {
		t.Fatalf("DispatchOnce: %v", err)
	}
	want := map[string]dto.MetricType{
		"outbox_messages":                 dto.MetricType_GAUGE,
		"outbox_oldest_due_age_seconds":   dto.MetricType_GAUGE,
		"outbox_published_total":          dto.MetricType_COUNTER,
		"outbox_publish_duration_seconds": dto.MetricType_HISTOGRAM,
		"outbox_batch_messages":           dto.MetricType_HISTOGRAM,
		"outbox_commit_to_accept_seconds": dto.MetricType_HISTOGRAM,
	}
	mfs := scrape(t, reg)
	if len(mfs) != len(want) {
		t.Errorf("registry has %d families, want %d", len(mfs), len(want))
	}
	for name, typ := range want {
		if mf, ok := mfs[name]; !ok || mf.GetType() != typ {
			t.Errorf("%s: got %v, want a %v", name, mf.GetType(), typ)
		}
	}
}

func TestNewRejectsBadInput(t *testing.T) {
	cases := []struct {
		name string
		reg  prometheus.Registerer
		opt  outboxprom.Option
		want string
	}{
		{"nil registerer", nil, nil, "New: nil Registerer"},
		{"no event types", prometheus.NewRegistry(), outboxprom.WithMaxEventTypes(0), "WithMaxEventTypes"},
		{"negative cache", prometheus.NewRegistry(), outboxprom.WithStatsCacheFor(-time.Second), "WithStatsCacheFor"},
		{"zero timeout", prometheus.NewRegistry(), outboxprom.WithStatsTimeout(0), "WithStatsTimeout"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var opts []outboxprom.Option
			if tc.opt != nil {
				opts = append(opts, tc.opt)
			}
			_, err := outboxprom.New(tc.reg, opts...)
			if !errors.Is(err, outbox.ErrInvalidOption) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New: %v, want ErrInvalidOption naming %s", err, tc.want)
			}
		})
	}
}

func TestSecondNewOnOneRegistryFailsAndRegistersNothing(t *testing.T) {
	reg := prometheus.NewRegistry()
	if _, err := outboxprom.New(reg); err != nil {
		t.Fatalf("first New: %v", err)
	}
	before := testutil.CollectAndCount(reg)
	_, err := outboxprom.New(reg)
	var already prometheus.AlreadyRegisteredError
	if !errors.As(err, &already) {
		t.Fatalf("second New: %v, want AlreadyRegisteredError", err)
	}
	if after := testutil.CollectAndCount(reg); after != before {
		t.Fatalf("%d series after the failed New, %d before", after, before)
	}
}

func TestTwoOutboxesRegisterBesideEachOtherWithALabel(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	for _, name := range []string{"orders", "payments"} {
		m, err := outboxprom.New(prometheus.WrapRegistererWith(prometheus.Labels{"outbox": name}, reg))
		if err != nil {
			t.Fatalf("New for %s: %v", name, err)
		}
		p := m.Wrap(outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil }))
		if err := p.Publish(context.Background(), outbox.Batch{ID: name, Messages: []outbox.Message{{EventID: name, EventType: "t"}}}); err != nil {
			t.Fatal(err)
		}
	}
	mfs := scrape(t, reg)
	for _, name := range []string{"orders", "payments"} {
		if v := series(mfs, "outbox_published_total", "event_type=t", "outbox="+name, "outcome=accepted").GetCounter().GetValue(); v != 1 {
			t.Errorf("outbox_published_total{outbox=%q} = %v, want 1", name, v)
		}
	}
}

func TestWatchRejectsNilAndASecondDispatcher(t *testing.T) {
	db := openOutbox(t, outboxtest.SQLite)
	m, _ := newMetrics(t)
	if err := m.Watch(nil); !errors.Is(err, outbox.ErrInvalidOption) {
		t.Fatalf("Watch(nil): %v, want ErrInvalidOption", err)
	}
	d := newDispatcher(t, db, outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil }))
	if err := m.Watch(d); err != nil {
		t.Fatalf("Watch: %v", err)
	}
	if err := m.Watch(d); !errors.Is(err, outboxprom.ErrAlreadyWatching) {
		t.Fatalf("second Watch: %v, want ErrAlreadyWatching", err)
	}
}
