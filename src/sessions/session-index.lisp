;;;; An index of Hunchentoot's in-process session database, by session id,
;;;; so that a request finds its session in constant time where Hunchentoot
;;;; searches the database's list (356 us a request among 40,000 sessions,
;;;; bench/profiles/2026-11-27-session-lookup.txt).
;;;;
;;;; The database stays Hunchentoot's: the alist HUNCHENTOOT:SESSION-DB
;;;; returns (one global list by default, which every acceptor of the
;;;; process shares), changed only by Hunchentoot's own code, under any
;;;; class of acceptor.  The index follows it without being told of changes:
;;;;
;;;; - A session enters the database by START-SESSION, which puts its pair
;;;;   (id . session) in front of the list.  A lookup that finds another
;;;;   list than the one it last saw indexes its pairs from the front up to
;;;;   the first pair it already holds: the pairs behind it were seen.
;;;;   SESSION-GC's list is a new one made of pairs already held, so the
;;;;   walk stops at its first.  A list none of whose pairs is held (the
;;;;   database replaced or emptied, RESET-SESSIONS) is indexed anew.
;;;; - A session leaves it by REMOVE-SESSION, SESSION-GC or RESET-SESSIONS,
;;;;   which each call ACCEPTOR-REMOVE-SESSION.  A session started under a
;;;;   parallel acceptor is an IN-PROCESS-SESSION, which that call marks
;;;;   removed, under whatever acceptor it is made; the index answers NIL for
;;;;   it and lets it go.  Any other session (one Hunchentoot's own acceptor
;;;;   started, sharing the database) is looked up in the list itself when
;;;;   the index holds it, since its removal leaves no mark.
;;;; - Pairs of removed sessions stay in the table until looked up, or
;;;;   until the table holds twice the pairs it held when last indexed anew,
;;;;   when it is indexed anew: it never holds more than twice the database.
;;;;
;;;; - The index knows the earliest time one of its sessions may expire
;;;;   (each one's last click plus max time; a session not an
;;;;   IN-PROCESS-SESSION, whose max time may change unseen, is asked at each
;;;;   check -- those not yet one of ours, among them), so that Hunchentoot's
;;;;   SESSION-GC, due every *SESSION-GC-FREQUENCY* new sessions, is skipped
;;;;   while it would find nothing to remove: its walk of the whole list
;;;;   with a clock reading a session was 43% of a new visitor's request
;;;;   among 60,000 sessions (bench/profiles/2026-11-27-application-sessions.txt).
;;;;   A click, or a longer max time, only delays a session's expiry; a
;;;;   shorter one (HUNCHENTOOT:SESSION-MAX-TIME) makes every index's time
;;;;   unknown until its next SESSION-GC.
;;;;
;;;; So a lookup answers as (ASSOC ID (SESSION-DB ACCEPTOR) :TEST #'=) does,
;;;; for every database Hunchentoot's session functions make.  A list
;;;; changed in place other than by them (a pair put behind others, or cut
;;;; out without ACCEPTOR-REMOVE-SESSION) is not followed.
;;;;
;;;; Locking: each index has one mutex, held for the comparison of lists,
;;;; the walk and the table access; never while anything else is called.

(in-package #:hunchentoot-recycling-taskmaster)

(defclass in-process-session (hunchentoot:session)
  ((removed-p
    :initform nil :accessor in-process-session-removed-p
    :documentation "True once HUNCHENTOOT:ACCEPTOR-REMOVE-SESSION has been
called for the session, under any acceptor: it has left the database.")
   (verified-client
    :initform nil :accessor in-process-session-verified-client
    :documentation "What the last check of a cookie against the session
compared (see SESSION-STRING-VERIFIED-P): a VERIFIED-CLIENT, or NIL."))
  (:documentation "A session of Hunchentoot's in-process database started
under a parallel acceptor (SESSION-CREATED makes it one): Hunchentoot's
session, which the session index can tell has been removed, and which
remembers the last session string it verified."))

(defmethod hunchentoot:acceptor-remove-session :after (acceptor (session in-process-session))
  "Mark SESSION removed, for the session indexes that hold it."
  (declare (ignore acceptor))
  (setf (in-process-session-removed-p session) t))

(sb-ext:defglobal **max-time-changes** (list 0)
  "In its car, how many times an IN-PROCESS-SESSION's max time has been
made shorter: an index whose earliest expiry was found at another count
cannot trust it.")

(defmethod (setf hunchentoot:session-max-time) :around (seconds (session in-process-session))
  "Count the change when it shortens SESSION's max time, for the session
indexes' earliest expiry; a longer one only delays its expiry."
  (let ((before (hunchentoot:session-max-time session)))
    (multiple-value-prog1 (call-next-method)
      (when (< seconds before)
        (sb-ext:atomic-incf (car **max-time-changes**))))))

(defun session-expiry (session)
  "The universal time after which SESSION is too old, as
HUNCHENTOOT:SESSION-TOO-OLD-P tells it."
  (+ (session-last-click session) (hunchentoot:session-max-time session)))

(defconstant +session-index-floor+ 1024
  "The pairs a session index may hold before it is indexed anew, however
small the database: below it, letting removed pairs go is not worth a walk.")

(defstruct (session-index (:constructor make-session-index ()))
  "An index of one acceptor's in-process session database (see above)."
  (mutex (sb-thread:make-mutex :name "session index") :read-only t)
  ;; Session id -> its pair (id . session) of the database.
  (pairs (make-hash-table :test 'eql) :read-only t)
  ;; The database list the pairs were last brought up to.
  (database nil)
  ;; Pairs held when last indexed anew: twice this (at least
  ;; +SESSION-INDEX-FLOOR+) and it is indexed anew.
  (anew-count 0 :type fixnum)
  ;; No IN-PROCESS-SESSION of the database expires before this universal
  ;; time; NIL while it holds none.
  (earliest-expiry nil)
  ;; The database's other sessions, whose expiry is asked at each check.
  (unwatched '())
  ;; The car of **MAX-TIME-CHANGES** when EARLIEST-EXPIRY was found.
  (max-time-changes 0 :type fixnum))

(defclass in-process-sessions ()
  ((index
    :initform (make-session-index) :reader sessions-index
    :documentation "The index by id of the in-process session database
that HUNCHENTOOT:SESSION-DB returns for the acceptor."))
  (:documentation "Where a parallel acceptor without a SESSION-STORE keeps
its sessions: Hunchentoot's in-process database, found through an index."))

(defun note-expiry (index session)
  "Lower INDEX's earliest expiry to SESSION's when it is earlier, or, when
SESSION is not an IN-PROCESS-SESSION, keep it among those asked at each check."
  (if (typep session 'in-process-session)
      (let ((expiry (session-expiry session))
            (earliest (session-index-earliest-expiry index)))
        (when (or (null earliest) (< expiry earliest))
          (setf (session-index-earliest-expiry index) expiry)))
      (push session (session-index-unwatched index))))

(defun find-earliest-expiry (index database)
  "Set INDEX's earliest expiry and unwatched sessions from DATABASE."
  (setf (session-index-max-time-changes index) (car **max-time-changes**)
        (session-index-earliest-expiry index) nil
        (session-index-unwatched index) '())
  (dolist (pair database)
    (note-expiry index (cdr pair))))

(defun unwatched-session-expired-p (index now)
  "True when one of INDEX's unwatched sessions is too old at NOW; those
that have become IN-PROCESS-SESSIONs since (SESSION-CREATED makes them so
after START-SESSION has put them in the database) are watched from now."
  (let ((unwatched (session-index-unwatched index)))
    (setf (session-index-unwatched index) '())
    (dolist (session unwatched)
      (note-expiry index session))
    (some (lambda (session) (< (session-expiry session) now))
          (session-index-unwatched index))))

(defun index-database-anew (index database)
  "Make INDEX hold exactly the pairs of DATABASE."
  (let ((pairs (session-index-pairs index)))
    (clrhash pairs)
    (dolist (pair database)
      ;; The first pair of an id is ASSOC's answer.
      (unless (gethash (car pair) pairs)
        (setf (gethash (car pair) pairs) pair)))
    (setf (session-index-anew-count index) (hash-table-count pairs))
    (find-earliest-expiry index database)))

(defun unheld-front (pairs database)
  "The pairs in front of DATABASE up to the first that the table PAIRS
holds, the oldest first; second value, true when one held was met."
  (do ((tail database (cdr tail))
       (new '() (cons (car tail) new)))
      ((or (null tail) (eq (gethash (caar tail) pairs) (car tail)))
       (values new (not (null tail))))))

(defun follow-database (index database)
  "Bring INDEX up to DATABASE when it is another list than the one it last
saw: index its pairs up to the first already held; anew when none is, or
when the table has grown to twice what it held when last indexed anew."
  (when (eq database (session-index-database index))
    (return-from follow-database))
  (let ((pairs (session-index-pairs index)))
    (multiple-value-bind (new held-met) (unheld-front pairs database)
      (if (and (not held-met) (plusp (hash-table-count pairs)))
          ;; Not one pair of it is held: another database.
          (index-database-anew index database)
          (progn
            ;; Oldest first, so that of two pairs of one id the one in front wins, as for ASSOC.
            (dolist (pair new)
              (setf (gethash (car pair) pairs) pair)
              (note-expiry index (cdr pair)))
            (when (> (hash-table-count pairs)
                     (* 2 (max +session-index-floor+ (session-index-anew-count index))))
              (index-database-anew index database)))))
    (setf (session-index-database index) database)))

(defun indexed-pair (index database id)
  "The pair of the session with ID that INDEX holds once brought up to
DATABASE, or NIL."
  (sb-thread:with-mutex ((session-index-mutex index))
    (follow-database index database)
    (gethash id (session-index-pairs index))))

(defun sessions-may-have-expired-p (index database now)
  "True unless INDEX, brought up to DATABASE, knows that no session of it
is too old at the universal time NOW."
  (sb-thread:with-mutex ((session-index-mutex index))
    (follow-database index database)
    (let ((earliest (session-index-earliest-expiry index)))
      (or (/= (session-index-max-time-changes index) (car **max-time-changes**))
          (and earliest (< earliest now))
          (unwatched-session-expired-p index now)))))

(defun note-sessions-collected (index database)
  "Bring INDEX up to DATABASE, as SESSION-GC has just left it."
  (sb-thread:with-mutex ((session-index-mutex index))
    (follow-database index database)
    (find-earliest-expiry index database)))

(defun forget-indexed-pair (index pair)
  "Let INDEX forget PAIR, a pair of a session that has left the database."
  (sb-thread:with-mutex ((session-index-mutex index))
    (when (eq (gethash (car pair) (session-index-pairs index)) pair)
      (remhash (car pair) (session-index-pairs index)))))

(defun indexed-session (index database id)
  "The session with the integer ID in DATABASE, an in-process session
database, as (CDR (ASSOC ID DATABASE :TEST #'=)) finds it, through INDEX."
  (let ((pair (indexed-pair index database id)))
    (cond ((null pair) nil)
          ((not (typep (cdr pair) 'in-process-session))
           (cdr (assoc id database :test #'=)))
          ((in-process-session-removed-p (cdr pair))
           (forget-indexed-pair index pair)
           nil)
          (t (cdr pair)))))

;;; The check of a cookie's session string.

(defstruct (verified-client (:constructor make-verified-client (secret user-agent remote-addr start string)))
  "The inputs of Hunchentoot's session string for one client of a session,
and the string they made."
  (secret nil :read-only t)
  (user-agent nil :read-only t)
  (remote-addr nil :read-only t)
  (start nil :read-only t)
  (string nil :read-only t))

(defun session-string-verified-p (session string user-agent remote-addr)
  "True when STRING is SESSION's session string and the one Hunchentoot
makes for SESSION's id and start, the client's USER-AGENT and REMOTE-ADDR
(each only when Hunchentoot binds sessions to it) and its session secret,
as Hunchentoot's SESSION-VERIFY checks.  An IN-PROCESS-SESSION remembers
the inputs it last checked true, so that a returning client costs no MD5."
  (let ((secret (and (boundp 'hunchentoot:*session-secret*) hunchentoot:*session-secret*))
        (user-agent (and hunchentoot:*use-user-agent-for-sessions* user-agent))
        (remote-addr (and hunchentoot:*use-remote-addr-for-sessions* remote-addr))
        (start (hunchentoot:session-start session))
        (verified (and (typep session 'in-process-session) (in-process-session-verified-client session))))
    (and (string= string (session-string session))
         (if (and verified
                  (eq secret (verified-client-secret verified))
                  (equal user-agent (verified-client-user-agent verified))
                  (equal remote-addr (verified-client-remote-addr verified))
                  (eql start (verified-client-start verified)))
             (string= string (verified-client-string verified))
             (let ((made (session-string-for (hunchentoot:session-id session) user-agent remote-addr start)))
               (when (and secret (typep session 'in-process-session))
                 (setf (in-process-session-verified-client session)
                       (make-verified-client secret user-agent remote-addr start made)))
               (string= string made))))))
