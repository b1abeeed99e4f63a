package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

func TestSchedulerDeliversSkipsOverlapsAndStopsAfterBatchInFlight(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 2)
		var running, overlaps, calls atomic.Int32
		inPublish, release := make(chan struct{}), make(chan struct{})
		p := outbox.PublisherFunc(func(ctx context.Context, _ outbox.Batch) error {
			if running.Add(1) > 1 {
				overlaps.Add(1)
			}
			defer running.Add(-1)
			if calls.Add(1) == 1 {
				close(inPublish)
				<-release // hold the first run across several ticks
			}
			return nil
		})
		d := newDispatcher(t, b.db, p)
		s, err := outbox.NewScheduler(d, outbox.DefaultSchedule())
		mustNil(t, err)
		s.Start()
		<-inPublish
		time.Sleep(2200 * time.Millisecond) // two more ticks fall due meanwhile
		stopped := make(chan error, 1)
		go func() { stopped <- s.Stop(context.Background()) }()
		select {
		case err := <-stopped:
			t.Fatalf("Stop returned (%v) while a batch was in flight", err)
		case <-time.After(100 * time.Millisecond):
		}
		close(release)
		mustNil(t, <-stopped)
		if overlaps.Load() != 0 {
			t.Fatalf("%d dispatch runs overlapped", overlaps.Load())
		}
		if s := fmt.Sprint(states(t, b)); s != "[delivered delivered]" {
			t.Fatalf("states %s after stop, want the in-flight batch settled", s)
		}
		n := calls.Load()
		publishN(t, b.db, "a", 1)
		time.Sleep(1100 * time.Millisecond)
		if calls.Load() != n {
			t.Fatalf("the scheduler dispatched after Stop")
		}
	})
}

func TestNewSchedulerRejectsBadSpecs(t *testing.T) {
	db, _ := outboxtest.Open(t, outboxtest.SQLite, nil)
	mustNil(t, outbox.AutoMigrate(db))
	d := newDispatcher(t, db, &recorder{})
	for _, s := range []outbox.Schedule{
		{Dispatch: "every second"},
		{RetryFailed: "61 * * * * *"},
		{Cleanup: "* * *"},
	} {
		if _, err := outbox.NewScheduler(d, s); !errors.Is(err, outbox.ErrInvalidOption) {
			t.Errorf("NewScheduler(%+v): err = %v, want ErrInvalidOption", s, err)
		}
	}
}
