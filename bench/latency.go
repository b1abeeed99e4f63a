package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
)

// The latency scenario: a paced writer commits one order (one event) per
// transaction through GORM and the plugin at a steady rate, and stamps
// time.Now() just after the commit returns; one Dispatcher.Run publishes to
// a publisher that stamps time.Now() on receipt. Latency is the difference,
// per event. The writer and the dispatcher use separate *gorm.DB pools, as
// separate processes would, so the only wake-ups are the database's:
//
//   - notify: the plugin sends pg_notify in each writing transaction
//     (WithNotify(true)) and Run listens (WithListen(true));
//   - poll: no notification (WithNotify(false)), Run does not listen
//     (WithListen(false)) and polls at the default interval.
//
// Events committed during the warm-up are not counted.

const latencyWriters = 8

func runLatency(ctx context.Context, e *env, c config, r *report) error {
	var rows, work [][]string
	for _, mode := range []struct {
		key, label string
		notify     bool
	}{
		{"notify", "Run, listening (NOTIFY)", true},
		{"poll", fmt.Sprintf("Run, polling only (every %v)", outbox.DefaultPollInterval), false},
	} {
		res, err := retry(ctx, e, "latency "+mode.key, func() (latencyResult, error) { return measureLatency(ctx, e, c, mode.notify) })
		if err != nil {
			return fmt.Errorf("%s: %w", mode.key, err)
		}
		prefix := "latency_" + mode.key + "_"
		r.add(prefix+"p50", ms(res.p50), "ms")
		r.add(prefix+"p95", ms(res.p95), "ms")
		r.add(prefix+"p99", ms(res.p99), "ms")
		r.add(prefix+"rate", res.rate, "events/s")
		rows = append(rows, []string{mode.label, f1(res.rate), fmt.Sprintf("%d", res.n),
			f2(ms(res.p50)), f2(ms(res.p95)), f2(ms(res.p99)), f2(ms(res.max)), res.note})
		work = append(work, res.work.row(mode.label))
	}
	r.table(fmt.Sprintf("latency commit → publish, target %d events/s, %v per mode", c.rate, c.duration),
		[]string{"dispatcher", "events/s", "events", "p50 ms", "p95 ms", "p99 ms", "max ms", ""}, rows)
	r.table("latency: work asked of the server while writing, per event written (counted on the client)", latencyWorkHeader, work)
	return nil
}

type latencyResult struct {
	n                  int
	rate               float64
	p50, p95, p99, max time.Duration
	note               string
	work               latencyWork
}

// latencyWork is what the writer and the dispatcher sent while the writer
// wrote events, and in how many batches the events were published.
type latencyWork struct {
	events, batches  int
	elapsed          time.Duration
	writer, dispatch workSample
}

var latencyWorkHeader = []string{"dispatcher", "events", "batches", "events/batch", "dispatcher stmts/event",
	"dispatcher round trips/s", "dispatcher tx/event", "writer stmts/event", "writer tx/event"}

func (w latencyWork) row(label string) []string {
	if w.events == 0 || w.batches == 0 {
		return []string{label, fmt.Sprintf("%d", w.events), fmt.Sprintf("%d", w.batches), "-", "-", "-", "-", "-", "-"}
	}
	per := func(n int64) string { return f2(float64(n) / float64(w.events)) }
	return []string{label, fmt.Sprintf("%d", w.events), fmt.Sprintf("%d", w.batches),
		f1(float64(w.events) / float64(w.batches)), per(w.dispatch.statements),
		f1(float64(w.dispatch.roundTrips) / w.elapsed.Seconds()), per(w.dispatch.clientTx),
		per(w.writer.statements), per(w.writer.clientTx)}
}

// clientSample reads s's client-side counters.
func (s *schema) clientSample() workSample {
	return workSample{statements: s.work.statements.Load(), roundTrips: s.work.roundTrips.Load(), clientTx: s.work.transactions.Load()}
}

// stamps records, per event id, when its commit returned and when it was
// published.
type stamps struct {
	mu        sync.Mutex
	committed map[string]time.Time
	published map[string]time.Time
}

func (s *stamps) commit(id string, at time.Time) {
	s.mu.Lock()
	s.committed[id] = at
	s.mu.Unlock()
}

func (s *stamps) publish(b outbox.Batch, at time.Time) {
	s.mu.Lock()
	for _, m := range b.Messages {
		if _, dup := s.published[m.EventID]; !dup {
			s.published[m.EventID] = at
		}
	}
	s.mu.Unlock()
}

// missing counts committed events not yet published.
func (s *stamps) missing() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for id := range s.committed {
		if _, ok := s.published[id]; !ok {
			n++
		}
	}
	return n
}

func measureLatency(ctx context.Context, e *env, c config, notify bool) (latencyResult, error) {
	s, err := e.newSchema(ctx, "latency")
	if err != nil {
		return latencyResult{}, err
	}
	defer s.drop()

	writer, err := s.gormDB(latencyWriters)
	if err != nil {
		return latencyResult{}, err
	}
	defer closeGorm(writer)
	if err := writer.Use(outbox.Plugin(outbox.WithNotify(notify))); err != nil {
		return latencyResult{}, err
	}
	if err := writer.WithContext(ctx).AutoMigrate(&benchOrder{}); err != nil {
		return latencyResult{}, err
	}
	if err := outbox.AutoMigrate(writer.WithContext(ctx)); err != nil {
		return latencyResult{}, err
	}

	st := &stamps{committed: map[string]time.Time{}, published: map[string]time.Time{}}
	var batches atomic.Int64
	pub := outbox.PublisherFunc(func(_ context.Context, b outbox.Batch) error {
		batches.Add(1)
		st.publish(b, time.Now())
		return nil
	})
	// The dispatcher's connections count apart from the writer's.
	ds := &schema{name: s.name, DSN: s.DSN, e: s.e}
	dispDB, err := ds.gormDB(4)
	if err != nil {
		return latencyResult{}, err
	}
	defer closeGorm(dispDB)
	d, err := outbox.NewDispatcher(dispDB, pub, outbox.WithListen(notify),
		outbox.WithPollInterval(outbox.DefaultPollInterval), outbox.WithLogger(quietLogger))
	if err != nil {
		return latencyResult{}, err
	}
	runCtx, stopRun := context.WithCancel(ctx)
	runDone := make(chan error, 1)
	go func() { runDone <- d.Run(runCtx) }()
	defer func() {
		stopRun()
		<-runDone
	}()
	// Let Run start listening before the first commit.
	select {
	case <-ctx.Done():
		return latencyResult{}, ctx.Err()
	case <-time.After(200 * time.Millisecond):
	}

	warmup := min(time.Second, c.duration/5)
	measureFrom := time.Now().Add(warmup)
	writer0, dispatch0, batches0 := s.clientSample(), ds.clientSample(), batches.Load()
	written, elapsed, err := pacedWrites(ctx, writer, c, warmup+c.duration, st)
	if err != nil {
		return latencyResult{}, err
	}
	work := latencyWork{events: written, batches: int(batches.Load() - batches0), elapsed: elapsed,
		writer: s.clientSample().sub(writer0), dispatch: ds.clientSample().sub(dispatch0)}

	// Wait for the last events: at most two poll intervals and a margin.
	deadline := time.Now().Add(2*outbox.DefaultPollInterval + 5*time.Second)
	for st.missing() > 0 && time.Now().Before(deadline) && ctx.Err() == nil {
		time.Sleep(10 * time.Millisecond)
	}
	if err := ctx.Err(); err != nil {
		return latencyResult{}, err
	}

	st.mu.Lock()
	var lat []time.Duration
	unpublished := 0
	for id, at := range st.committed {
		if at.Before(measureFrom) {
			continue
		}
		p, ok := st.published[id]
		if !ok {
			unpublished++
			continue
		}
		lat = append(lat, p.Sub(at))
	}
	st.mu.Unlock()
	sortDurations(lat)
	res := latencyResult{
		n:    len(lat),
		rate: rate(written, elapsed),
		p50:  percentile(lat, 50), p95: percentile(lat, 95), p99: percentile(lat, 99),
		work: work,
	}
	if len(lat) > 0 {
		res.max = lat[len(lat)-1]
	}
	if unpublished > 0 {
		res.note = fmt.Sprintf("%d events not published in time", unpublished)
	}
	if res.rate < 0.95*float64(c.rate) {
		res.note += fmt.Sprintf(" writer reached %.0f of %d events/s", res.rate, c.rate)
	}
	return res, nil
}

// pacedWrites commits c.rate orders per second for d, from latencyWriters
// goroutines fed by a pacer, each order with a known event id whose commit
// it stamps. It returns how many it wrote and over how long.
func pacedWrites(ctx context.Context, db *gorm.DB, c config, d time.Duration, st *stamps) (int, time.Duration, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ticks := make(chan struct{}, c.rate)
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
		written  int
	)
	for w := range latencyWriters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(w+1), 42))
			for range ticks {
				o := newOrder(rnd, c.aggregates)
				o.EventID = uuid.Must(uuid.NewV7()).String()
				if err := db.WithContext(ctx).Create(&o).Error; err != nil {
					mu.Lock()
					if firstErr == nil && ctx.Err() == nil {
						firstErr = err
						cancel()
					}
					mu.Unlock()
					return
				}
				st.commit(o.EventID, time.Now())
				mu.Lock()
				written++
				mu.Unlock()
			}
		}()
	}

	// The pacer: by time t it has released rate*t ticks, so a late tick is
	// made up at once rather than lost.
	start := time.Now()
	interval := time.Second / time.Duration(c.rate)
	sent := 0
pace:
	for {
		elapsed := time.Since(start)
		if elapsed >= d {
			break
		}
		for due := int(elapsed / interval); sent <= due; sent++ {
			select {
			case ticks <- struct{}{}:
			case <-ctx.Done():
				break pace
			}
		}
		select {
		case <-ctx.Done():
			break pace
		case <-time.After(interval):
		}
	}
	close(ticks)
	wg.Wait()
	elapsed := time.Since(start)
	if firstErr != nil {
		return 0, 0, firstErr
	}
	if err := ctx.Err(); err != nil {
		return 0, 0, err
	}
	return written, elapsed, nil
}
