package outboxotel

import (
	"context"
	"fmt"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/telemetry"
)

// Watch registers the gauges outbox_messages (attribute state: pending,
// delivering, retry, failed) and outbox_oldest_due_age_seconds (how long
// the longest-waiting due row has waited, 0 when none is due) with the
// meter provider of the options (see [WithMeterProvider]). They are
// observed at each collection from [outbox.Dispatcher.Stats], read at most
// once per [WithStatsCacheFor]; a failed reading is returned by the
// callback, which the SDK reports through otel.Handle, and observes
// nothing. Any dispatcher of the table will do. Unregister the returned
// registration to stop.
//
// It fails with an error wrapping [outbox.ErrInvalidOption] when d is nil
// or an option is invalid, and with the meter's error when it cannot
// create the gauges or register their callback.
func Watch(d *outbox.Dispatcher, opts ...Option) (metric.Registration, error) {
	if d == nil {
		return nil, fmt.Errorf("%w: outboxotel: Watch: nil Dispatcher", outbox.ErrInvalidOption)
	}
	c, err := newConfig(opts)
	if err != nil {
		return nil, fmt.Errorf("outboxotel: Watch: %w", err)
	}
	meter := c.mp.Meter(ScopeName)
	messages, err := meter.Int64ObservableGauge("outbox_messages",
		metric.WithDescription("Outbox rows by delivery state (pending, delivering, retry, failed)."),
		metric.WithUnit("{message}"))
	if err != nil {
		return nil, fmt.Errorf("outboxotel: Watch: %w", err)
	}
	oldest, err := meter.Float64ObservableGauge("outbox_oldest_due_age_seconds",
		metric.WithDescription("How long the longest-waiting due outbox row has waited; 0 when none is due."),
		metric.WithUnit("s"))
	if err != nil {
		return nil, fmt.Errorf("outboxotel: Watch: %w", err)
	}
	var states [len(telemetry.States)]metric.ObserveOption
	for i, s := range telemetry.States {
		states[i] = metric.WithAttributeSet(attribute.NewSet(attribute.String("state", s)))
	}
	cache := telemetry.NewStatsCache(d, c.cacheFor, c.timeout)
	reg, err := meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		s, err := cache.Get(ctx)
		if err != nil {
			return fmt.Errorf("outboxotel: %w", err)
		}
		for i, n := range telemetry.Gauges(s) {
			o.ObserveInt64(messages, n, states[i])
		}
		o.ObserveFloat64(oldest, telemetry.OldestDueAge(s, time.Now()))
		return nil
	}, messages, oldest)
	if err != nil {
		return nil, fmt.Errorf("outboxotel: Watch: %w", err)
	}
	return reg, nil
}
