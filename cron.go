package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/robfig/cron/v3"
)

// Schedule holds the cron specs of the dispatcher's three jobs, each with a
// leading seconds field ("sec min hour dom month dow") or a descriptor such
// as "@every 5s". An empty spec leaves that job out.
//
// Cron runs a job at most once a second, so a scheduled dispatcher picks up
// a commit within about a second; [Dispatcher.Run] reacts at once. Messages
// reported as not attempted become due again after the dispatcher's poll
// interval (see [WithPollInterval]), so keep that interval at or below the
// dispatch period.
type Schedule struct {
	// Dispatch claims and publishes; each run drains while batches come
	// back full.
	Dispatch string
	// RetryFailed is the retry_failed sweep; see [Dispatcher.RetryFailed].
	RetryFailed string
	// Cleanup deletes delivered rows past the retention; see
	// [Dispatcher.Cleanup].
	Cleanup string
}

// DefaultSchedule dispatches every second, sweeps dead-lettered rows back
// every minute and cleans up hourly.
func DefaultSchedule() Schedule {
	return Schedule{Dispatch: "* * * * * *", RetryFailed: "0 * * * * *", Cleanup: "0 0 * * * *"}
}

// Scheduler runs a [Dispatcher]'s jobs on a robfig/cron/v3 scheduler. A run
// that is due while the previous run of the same job is still going is
// skipped, and a panic in a job is recovered and logged; both through the
// dispatcher's log/slog logger.
type Scheduler struct {
	cron   *cron.Cron
	ctx    context.Context
	cancel context.CancelFunc
	once   sync.Once
}

// NewScheduler registers d's dispatch, retry_failed and cleanup jobs with
// the specs of s on a new cron scheduler that understands seconds. Extra
// cron options (a time zone, say) are applied after the library's own. It
// fails, naming the job, when a spec does not parse.
//
// Call Start to begin and Stop to end.
func NewScheduler(d *Dispatcher, s Schedule, opts ...cron.Option) (*Scheduler, error) {
	if d == nil {
		return nil, fmt.Errorf("%w: NewScheduler: nil *Dispatcher", ErrInvalidOption)
	}
	logger := cronLogger{d.log}
	parser := cron.NewParser(cron.SecondOptional | cron.Second | cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)
	c := cron.New(append([]cron.Option{
		cron.WithParser(parser),
		cron.WithLogger(logger),
		cron.WithChain(cron.Recover(logger), cron.SkipIfStillRunning(logger)),
	}, opts...)...)
	ctx, cancel := context.WithCancel(context.Background())
	sc := &Scheduler{cron: c, ctx: ctx, cancel: cancel}
	jobs := []struct {
		name, spec string
		run        func(ctx context.Context) error
	}{
		{"dispatch", s.Dispatch, func(ctx context.Context) error {
			// Drain while claims stop for want of room; a stop lets the
			// batch in flight publish and settle, and claims no more.
			for ctx.Err() == nil {
				r, err := d.Dispatch(context.WithoutCancel(ctx))
				if err != nil || !r.More {
					return err
				}
			}
			return nil
		}},
		{"retry_failed", s.RetryFailed, func(ctx context.Context) error { _, err := d.RetryFailed(ctx); return err }},
		{"cleanup", s.Cleanup, func(ctx context.Context) error { _, err := d.Cleanup(ctx); return err }},
	}
	for _, j := range jobs {
		if j.spec == "" {
			continue
		}
		if _, err := c.AddFunc(j.spec, func() {
			if err := j.run(sc.ctx); err != nil && !errors.Is(err, context.Canceled) {
				d.log.Error("outbox: scheduled job failed", "job", j.name, "error", err)
			}
		}); err != nil {
			cancel()
			return nil, fmt.Errorf("%w: NewScheduler: %s spec %q: %w", ErrInvalidOption, j.name, j.spec, err)
		}
	}
	return sc, nil
}

// Start starts the scheduler in its own goroutine. It does nothing if the
// scheduler is running already.
func (s *Scheduler) Start() { s.cron.Start() }

// Stop stops scheduling new runs, lets the runs in progress finish (a
// dispatch run publishes and settles its batch in flight, then claims no
// more) and waits for them until ctx ends. It returns ctx.Err() if ctx ended
// first, nil otherwise. Stop may be called more than once.
func (s *Scheduler) Stop(ctx context.Context) error {
	s.once.Do(s.cancel)
	done := s.cron.Stop()
	select {
	case <-done.Done():
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// cronLogger adapts a *slog.Logger to cron.Logger.
type cronLogger struct{ l *slog.Logger }

func (c cronLogger) Info(msg string, kv ...any) {
	c.l.Debug("outbox: cron: "+msg, kv...)
}

func (c cronLogger) Error(err error, msg string, kv ...any) {
	c.l.Error("outbox: cron: "+msg, append([]any{"error", err}, kv...)...)
}
