;;;; The session store protocol: where a parallel acceptor keeps the
;;;; sessions of Hunchentoot's session API when they must outlive a process
;;;; or be shared by several.
;;;;
;;;; An acceptor without a store (:SESSION-STORE NIL, the default) keeps
;;;; Hunchentoot's own in-process sessions.  With a store, a request's
;;;; session is read from the store when the request presents its cookie
;;;; (FIND-STORED-SESSION), lives in the request as an ordinary
;;;; HUNCHENTOOT:SESSION of the class STORED-SESSION, and is written back at
;;;; the end of the request when the handler changed it (SAVE-STORED-SESSION);
;;;; START-SESSION adds it, REMOVE-SESSION and SESSION-GC remove it.  So
;;;; HUNCHENTOOT:SESSION-VALUE and the rest of the API work unchanged, and a
;;;; session's changes are seen by the next request, whichever process
;;;; serves it.  Two requests of one session served at once each write the
;;;; session as their handler left it: the later write wins.
;;;;
;;;; A store's methods signal SESSION-STORE-UNAVAILABLE when they fail; the
;;;; acceptor bounds each call with its SESSION-STORE-TIMEOUT (a deadline:
;;;; every wait inside the call ends then), so a method need not.  A method
;;;; left by a non-local exit (the deadline) must leave the store usable.
;;;;
;;;; Locking: a store is called from every worker at once; it guards its
;;;; own state.  The outage bookkeeping below changes by compare-and-swap.

(in-package #:hunchentoot-recycling-taskmaster)

(defstruct (session-store-outage (:constructor make-session-store-outage ()))
  "A store's current outage, if any."
  ;; When the outage began (the first call that failed after one that
  ;; answered) as a universal time and an internal real time, in a cons; NIL
  ;; while the store answers.
  (since nil)
  ;; Requests answered 503 since the outage began.
  (refused 0 :type sb-ext:word)
  ;; The internal real time the last outage ended: a call begun before then
  ;; that fails now is news of that outage, not of a new one.
  (ended-at 0 :type integer))

(defclass session-store ()
  ((outage
    :initform (make-session-store-outage) :reader session-store-outage
    :documentation "The store's current outage, for its two log lines."))
  (:documentation "Where a parallel acceptor's sessions are kept when they
must outlive its process: a subclass implements the generic functions below
(POSTGRESQL-SESSION-STORE is one)."))

(defgeneric find-stored-session (store id string time)
  (:documentation "The unexpired session of STORE with the integer ID and
the session string STRING, its last click set to the universal time TIME
in the store, as a new STORED-SESSION; NIL when there is none.  A session
with ID but another string is neither returned nor touched."))

(defgeneric add-stored-session (store session)
  (:documentation "Add SESSION, a new STORED-SESSION, to STORE; its values
are written as STORED-SESSION-DATA-TEXT."))

(defgeneric save-stored-session (store session)
  (:documentation "Write SESSION's string, start, maximum time and values
(STORED-SESSION-DATA-TEXT) to STORE, where its id already is."))

(defgeneric remove-stored-session (store session)
  (:documentation "Remove SESSION from STORE (nothing when it is not there)."))

(defgeneric expired-stored-sessions (store time)
  (:documentation "A list of STORE's sessions expired at the universal time
TIME (at most some hundreds; a later call gives the rest), as
STORED-SESSIONs."))

(defclass stored-session (hunchentoot:session)
  ((stored-fields
    :initform nil :accessor stored-fields
    :documentation "The session's fields as the store has them (see
SESSION-STORED-FIELDS), to tell at the end of a request whether the handler
changed it.")
   (removed
    :initform nil :accessor stored-session-removed-p
    :documentation "True once the session was removed from its store."))
  (:documentation "A HUNCHENTOOT:SESSION kept in a SESSION-STORE: one read
from the store, or one START-SESSION made (changed to this class when the
store adds it)."))

(defun session-stored-fields (session)
  "What a store keeps of SESSION that a request may change: its string,
start, maximum time and values (as text)."
  (list (session-string session)
        (hunchentoot:session-start session)
        (hunchentoot:session-max-time session)
        (session-data-text (session-data session))))

(defun stored-session-data-text (session)
  "SESSION's values as the text its store keeps, printed when the request
last looked for changes to SESSION (SESSION-STORED-FIELDS): what ADD- and
SAVE-STORED-SESSION write, so that the values are printed once."
  (fourth (stored-fields session)))

(defun make-stored-session (&rest fields &key id string user-agent remote-addr start
                                              last-click data max-time)
  "A STORED-SESSION with the fields a store read (see FILL-SESSION)."
  (declare (ignore id string user-agent remote-addr start last-click data max-time))
  (let ((session (apply #'fill-session (allocate-instance (find-class 'stored-session)) fields)))
    (setf (stored-fields session) (session-stored-fields session)
          (stored-session-removed-p session) nil)
    session))

(defclass unreachable-session (hunchentoot:session)
  ((store :initarg :store :reader unreachable-session-store
          :documentation "The store that did not answer."))
  (:documentation "The session of a request whose cookie names a session
its store could not be asked about.  Its Hunchentoot fields but the id
and string of the cookie are unbound, so that the first use of its values
or times signals SESSION-STORE-UNAVAILABLE (a 503), while a handler that
never looks at its session answers as usual."))

(defun make-unreachable-session (store id string)
  "The UNREACHABLE-SESSION of a cookie with ID and STRING, whose STORE did not answer."
  (let ((session (allocate-instance (find-class 'unreachable-session))))
    (setf (slot-value session 'store) store)
    (fill-session-identity session id string)))

(defmethod slot-unbound (class (session unreachable-session) slot-name)
  (declare (ignore class))
  (if (session-field-slot-p slot-name)
      (error 'session-store-unavailable
             :store (unreachable-session-store session)
             :reason "it did not answer when the request's session was looked up")
      (call-next-method)))

;;; The outage bookkeeping: one log line when an outage begins, one when it
;;; ends.

(defun note-session-store-failed (store condition call-started)
  "Record that a call to STORE begun at the internal real time CALL-STARTED
failed with CONDITION (a SESSION-STORE-UNAVAILABLE); log it when it begins
an outage."
  (let ((outage (session-store-outage store)))
    (when (and (> call-started (session-store-outage-ended-at outage))
               (compare-and-swap (session-store-outage-since outage) nil
                                 (cons (get-universal-time) (get-internal-real-time))))
      (hunchentoot:log-message* :error "~A; requests that need their session are answered 503 ~
until it answers again."
                                condition))))

(defun note-session-store-refused (store)
  "Record that a request was answered 503 for want of STORE."
  (atomic-increment (session-store-outage-refused (session-store-outage store))))

(defun note-session-store-answered (store call-started)
  "Record that a call to STORE begun at the internal real time CALL-STARTED
answered; log the end of an outage when the call began after it: one begun
before may have had its answer before the store stopped answering, and
would end the outage early, to be logged as begun again by the next call
that fails."
  (let* ((outage (session-store-outage store))
         (since (session-store-outage-since outage)))
    (when (and since
               (> call-started (cdr since))
               (compare-and-swap (session-store-outage-since outage) since nil))
      (setf (session-store-outage-ended-at outage) (get-internal-real-time))
      (let ((refused (session-store-outage-refused outage)))
        (atomic-add (session-store-outage-refused outage) (- refused))
        (hunchentoot:log-message* :info "The session store ~A answers again after ~D s; ~D ~
request~:P were answered 503 meanwhile."
                                  store (- (get-universal-time) (car since)) refused)))))
