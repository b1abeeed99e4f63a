package outbox

import (
	"database/sql"
	"sync"

	"gorm.io/gorm"
)

// Transaction runs fc in a transaction of db, exactly as db.Transaction
// does (the same commit, rollback, savepoints and error), and wakes the
// dispatchers once it has committed, if the model writes and [Publish]
// calls of fc recorded events. It fails with [ErrPluginNotRegistered],
// before fc runs, when the outbox plugin is not registered on db.
//
// Use it instead of db.Transaction for transactions that record events,
// when several of them may run at once. Under db.Transaction the plugin
// cannot see the commit, so on PostgreSQL each such transaction asks for a
// notification at its own commit, and PostgreSQL makes transactions that
// notify commit one at a time (see [WithNotify]). Under Transaction the
// plugin sees the commit: overlapping transactions leave the notification
// to one sent after their commits, as GORM's per-statement transactions
// do, and commit side by side. The dispatchers of this process are woken
// after the commit, not before it.
//
// Called on a db that is already in a transaction, Transaction is
// db.Transaction (a savepoint): the commit it would see is not the one
// that makes the events visible, so their writes notify as under
// db.Transaction.
func Transaction(db *gorm.DB, fc func(tx *gorm.DB) error, opts ...*sql.TxOptions) error {
	p, err := pluginOf(db)
	if err != nil {
		return err
	}
	if _, inTx := db.Statement.ConnPool.(gorm.TxCommitter); inTx {
		return db.Transaction(fc, opts...)
	}
	w := &txWrites{p: p}
	defer w.end()
	// A session of its own, so that the setting stays off db's statement
	// (db.Set would store it there when db is a chain).
	if err := db.Session(&gorm.Session{}).Set(txWritesKey, w).Transaction(fc, opts...); err != nil {
		return err
	}
	w.committed()
	return nil
}

// txWritesKey is the setting under which the statements of a Transaction
// find its txWrites.
const txWritesKey = "outbox:transaction"

// txWrites is what a Transaction learns about the event writes in it.
type txWrites struct {
	p *OutboxPlugin

	mu       sync.Mutex
	ended    bool      // the transaction is over: its statements write as any others
	counted  bool      // counted in OutboxPlugin.ownInFlight
	notifier *notifier // sends the notification after the commit, if any
	notified bool      // a write asked the engine to notify at the commit
	wrote    bool      // a write stored events
}

// txWritesOf returns the Transaction of p that db's statement runs in, or
// nil.
func txWritesOf(db *gorm.DB, p *OutboxPlugin) *txWrites {
	v, _ := db.Get(txWritesKey)
	w, _ := v.(*txWrites)
	if w == nil || w.p != p {
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.ended {
		return nil
	}
	return w
}

// write stores events through db's connection, in w's transaction, and
// decides as for a transaction whose commit the plugin sees whether it
// asks the engine to notify at the commit: not when an earlier write in
// the transaction did already.
func (w *txWrites) write(db *gorm.DB, events []Event) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.counted {
		w.counted = true
		w.p.ownInFlight.Add(1)
		w.notifier = w.p.notifierFor(db)
	}
	notify := !w.notified && w.p.notifyInside(w.notifier, true)
	notified, err := w.p.write(db.Statement.Context, db, db.Statement.ConnPool, events, notify)
	w.notified = w.notified || notified
	// A failed write may have stored some events: a wake-up that finds
	// nothing costs less than one missed.
	w.wrote = w.wrote || len(events) > 0
	return err
}

// committed wakes the dispatchers after the transaction committed: this
// process's directly, the others through the notifier unless a write
// asked for a notification at the commit.
func (w *txWrites) committed() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.wrote {
		w.p.committed(w.notifier, w.notified)
	}
}

// end takes the transaction out of ownInFlight once it has ended.
func (w *txWrites) end() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.ended = true
	if w.counted {
		w.counted = false
		w.p.ownInFlight.Add(-1)
	}
}
