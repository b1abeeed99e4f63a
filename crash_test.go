package outbox_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// TestKillDispatchersMidFlight is the kill -9 test. Writers commit and roll
// back random transactions through the plugin (creates and updates of
// orders, and outbox.Publish) while three dispatcher processes deliver to a
// publisher that appends what it accepts to a file. The test kills a random
// dispatcher with SIGKILL every few hundred milliseconds, wherever it is
// (claiming, publishing, settling, waiting), and starts a new one. At the
// end:
//   - every committed event was accepted at least once;
//   - no event of a rolled-back transaction was ever accepted, and none is
//     in the table;
//   - no event was accepted before its business row was visible to the
//     publisher's own connection;
//   - per aggregate, first acceptances come in sequence order;
//   - every redelivery is explained: the previous acceptance came from the
//     last batch of a process that was then killed, or from a batch whose
//     lease ran out before its settle took effect.
//
// It runs in parallel with the other parallel top-level tests, after the
// sequential ones (the server restart, the load test).
func TestKillDispatchersMidFlight(t *testing.T) {
	t.Parallel()
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		dir := t.TempDir()
		cfg := helperConfig{Engine: e, DSN: b.info.DSN, Out: filepath.Join(dir, "accepted.jsonl"), Log: filepath.Join(dir, "dispatchers.jsonl"),
			Lease: time.Second, FailEvery: 7, Delay: 100 * time.Millisecond, BatchSize: 10}
		const processes, writers = 3, 3
		runFor := 6 * time.Second

		type proc struct {
			cmd     *exec.Cmd
			started time.Time
		}
		var procs []proc
		for range processes {
			procs = append(procs, proc{startDispatcherProcess(t, cfg), time.Now()})
		}

		// Writers.
		var (
			wg         sync.WaitGroup
			mu         sync.Mutex
			committed  = map[string]int{}  // transaction key -> events it wrote
			rolledBack = map[string]bool{} // transaction key
		)
		stop := time.Now().Add(runFor)
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var mine []Order
				for i := 0; time.Now().Before(stop); i++ {
					// Paced so that the dispatchers keep up, and kills land
					// on a system in its steady state.
					time.Sleep(rand.N(40 * time.Millisecond))
					key := fmt.Sprintf("w%d-%d", w, i)
					rollback := rand.IntN(10) < 3
					events, err := crashTransaction(b.db, key, &mine, rollback)
					switch {
					case rollback && errors.Is(err, errRollback):
						mu.Lock()
						rolledBack[key] = true
						mu.Unlock()
					case !rollback && err == nil:
						mu.Lock()
						committed[key] = events
						mu.Unlock()
					default:
						t.Errorf("transaction %s (rollback %v): %v", key, rollback, err)
						return
					}
				}
			}()
		}

		// The killer.
		type kill struct {
			pid   int
			batch string // the batch the process published last
			where string
		}
		var kills []kill
		for time.Now().Before(stop) {
			time.Sleep(200*time.Millisecond + rand.N(400*time.Millisecond))
			// A victim that has started up and published (or had the time
			// to), so that most kills land in a claim, a publish or a
			// settle rather than in the start-up of the process.
			working := map[int]bool{}
			for _, l := range readHelperLog(t, cfg.Log) {
				working[l.PID] = true
			}
			var grown []int
			for i, p := range procs {
				if working[p.cmd.Process.Pid] || time.Since(p.started) > 2*time.Second {
					grown = append(grown, i)
				}
			}
			if len(grown) == 0 {
				continue
			}
			i := grown[rand.IntN(len(grown))]
			victim := procs[i].cmd
			_ = victim.Process.Kill()
			_ = victim.Wait()
			procs[i] = proc{startDispatcherProcess(t, cfg), time.Now()}
			k := kill{pid: victim.Process.Pid, where: "before its first publish"}
			var phase string
			for _, l := range readHelperLog(t, cfg.Log) {
				if l.PID == k.pid && l.Msg == helperPublishMsg {
					k.batch, phase = l.BatchID, l.Phase
				}
			}
			switch {
			case phase == "start":
				k.where = "mid-publish"
			case k.batch != "":
				k.where = "between batches (claiming or waiting)"
				var delivering int64
				mustNil(t, b.db.Raw(`SELECT count(*) FROM outbox_records WHERE batch_id = ? AND delivery_state = 'delivering'`, k.batch).Scan(&delivering).Error)
				if delivering > 0 {
					k.where = "after publish, before its settle committed"
				}
			}
			kills = append(kills, k)
		}
		wg.Wait()
		if t.Failed() {
			return
		}

		// Drain: the surviving processes deliver the rest.
		waitAllDelivered(t, b.db, 30*time.Second)
		all := map[string]bool{}
		wantEvents := 0
		for _, n := range committed {
			wantEvents += n
		}
		rows := b.records(t)
		for _, r := range rows {
			all[r.EventID] = true
		}
		if len(rows) != wantEvents {
			t.Errorf("%d events in the table, want %d from %d committed transactions", len(rows), wantEvents, len(committed))
		}
		for key := range committed {
			if !all["p-"+key] {
				t.Errorf("committed transaction %s: its published event is missing", key)
			}
		}
		for key := range rolledBack {
			if all["p-"+key] {
				t.Errorf("rolled-back transaction %s: its published event is in the table", key)
			}
		}

		as := readAcceptances(t, cfg.Out)
		redeliveries := checkAcceptances(t, as, all)
		for _, a := range as {
			if key, ok := strings.CutPrefix(a.EventID, "p-"); ok && rolledBack[key] {
				t.Errorf("event %s of a rolled-back transaction was accepted", a.EventID)
			}
		}

		// Explain every redelivery.
		lastBatchOfKilled := map[int]string{}
		where := map[string]int{}
		for _, k := range kills {
			lastBatchOfKilled[k.pid] = k.batch
			where[k.where]++
		}
		timedOut := timedOutBatches(readHelperLog(t, cfg.Log))

		byKill, byTimeout := 0, 0
		prev := map[string]acceptance{}
		for _, a := range as {
			p, again := prev[a.EventID]
			prev[a.EventID] = a
			if !again {
				continue
			}
			switch {
			case lastBatchOfKilled[p.PID] == p.Batch && p.Batch != "":
				byKill++
			case timedOut[p.Batch] != "":
				byTimeout++
			default:
				t.Errorf("event %s (%s #%d) accepted again by process %d (batch %s) after process %d accepted it in batch %s, which was neither killed before settling nor timed out",
					a.EventID, a.Aggregate, a.Sequence, a.PID, a.Batch, p.PID, p.Batch)
			}
		}

		pids := map[int]bool{}
		for _, a := range as {
			pids[a.PID] = true
		}
		var places []string
		for w, n := range where {
			places = append(places, fmt.Sprintf("%d %s", n, w))
		}
		sort.Strings(places)
		summary(t, "kill-9 %s: %d transactions committed, %d rolled back; %d dispatcher processes killed with SIGKILL (%v), %d processes accepted; %d events, all delivered, none lost; %d acceptances, %d redeliveries (%d after a kill, %d after a lease timeout); 0 events of rolled-back transactions accepted",
			e, len(committed), len(rolledBack), len(kills), places, len(pids), len(rows), len(as), redeliveries, byKill, byTimeout)
		if len(kills) == 0 {
			t.Errorf("no process was killed")
		}
	})
}

// crashTransaction runs one transaction of the kill -9 test: it creates an
// order or updates one of the writer's committed orders, publishes an event
// on that order with the ID "p-"+key, and, now and then, one on a shared
// aggregate. It commits, or rolls back when told to (returning
// errRollback). It returns how many events the transaction wrote.
func crashTransaction(db *gorm.DB, key string, mine *[]Order, rollback bool) (int, error) {
	events := 0
	var o Order
	err := db.Transaction(func(tx *gorm.DB) error {
		if len(*mine) == 0 || rand.IntN(2) == 0 {
			o = Order{Status: key, Total: rand.IntN(100)}
			if err := tx.Create(&o).Error; err != nil {
				return err
			}
		} else {
			o = (*mine)[rand.IntN(len(*mine))]
			if err := tx.Model(&o).Update("status", key).Error; err != nil {
				return err
			}
		}
		events++
		if err := outbox.Publish(tx, outbox.Event{ID: "p-" + key, IdempotencyKey: "p-" + key, Type: "order.noted",
			AggregateType: "order", AggregateID: fmt.Sprint(o.ID), Payload: map[string]string{"tx": key}}); err != nil {
			return err
		}
		events++
		if rand.IntN(3) == 0 {
			if err := outbox.Publish(tx, outbox.Event{Type: "shop.counted", AggregateType: "shop", AggregateID: "all", Payload: map[string]string{"tx": key}}); err != nil {
				return err
			}
			events++
		}
		if rollback {
			return errRollback
		}
		return nil
	})
	if err == nil {
		*mine = append(*mine, o)
	}
	return events, err
}
