package outbox

import (
	"gorm.io/gorm"
)

// Publish records events that are not tied to a model write, through tx's
// connection: inside the caller's transaction when tx is one (typically the
// tx of db.Transaction or of [Transaction]), so that the events commit if
// and only if it does. Called outside a transaction, Publish opens one for
// the events alone, so that they are written all or none.
//
// Every event is validated and encoded before anything is written; an
// invalid one fails the whole call with an error wrapping
// [ErrInvalidEvent]. A call that fails leaves none of its events behind,
// even when the caller goes on and commits its transaction (a savepoint
// surrounds the writes on engines where a failed statement does not abort
// the transaction). An event whose IdempotencyKey is already stored is
// skipped without error. Publish fails with [ErrPluginNotRegistered] when
// the outbox plugin was not registered on tx.
func Publish(tx *gorm.DB, events ...Event) error {
	if tx.Error != nil {
		return tx.Error
	}
	p, err := pluginOf(tx)
	if err != nil {
		return err
	}
	if len(events) == 0 {
		return nil
	}
	if _, inTx := tx.Statement.ConnPool.(gorm.TxCommitter); inTx {
		// The caller may go on after an error and commit: the events are
		// written inside a savepoint where an error does not abort the
		// transaction.
		return p.record(tx, events, txWritesOf(tx, p), true)
	}
	w := &txWrites{p: p}
	defer w.end()
	err = tx.Transaction(func(tx *gorm.DB) error { return p.record(tx, events, w, false) })
	if err == nil {
		w.committed()
	}
	return err
}
