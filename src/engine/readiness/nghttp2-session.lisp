;;;; An HTTP/2 connection's protocol state, kept by libnghttp2 (sys/nghttp2.lisp):
;;;; the only file that calls it.  The library does no I/O: what the client
;;;; sent is given to RECEIVE-HTTP2-OCTETS, and the frames it makes are
;;;; taken by TAKE-HTTP2-OUTPUT, for the connection's outbox.  Its callbacks
;;;; run inside those two calls, in the calling thread, and find the session
;;;; in *HTTP2-SESSION*: no Lisp object passes through C, and no Lisp error
;;;; unwinds through it (each callback answers the library's failure code).
;;;;
;;;; Locking.  libnghttp2 is not thread-safe: every call on a session is made
;;;; with its LOCK held -- by the connection's holder reading frames, or by
;;;; the worker whose handler answers one of its streams.  Its streams'
;;;; replies are kept under it too.  FREE-HTTP2-SESSION also takes it, so
;;;; that a late answer finds the session gone, not freed memory.
;;;;
;;;; A reply's body is given to the library as it is made (QUEUE-HTTP2-REPLY-OCTETS):
;;;; the library reads it as flow control lets DATA frames go, and waits
;;;; (its read deferred) while none is there.  What waits is counted in the
;;;; memory budget until the library has read it.
;;;;
;;;; What a client may cost is counted as the callbacks see it
;;;; (http2-session.lisp).  Each stream's request is kept by
;;;; http2-stream.lisp.

(in-package #:hunchentoot-recycling-taskmaster)

(defvar *http2-session* nil
  "The HTTP2-SESSION whose library call the calling thread is in, for the
callbacks.")

(defun http2-stream-of (stream-id)
  (gethash stream-id (http2-session-streams *http2-session*)))

(defun foreign-octets (pointer length)
  "The LENGTH octets at POINTER, copied into a fresh vector."
  (let ((octets (make-array length :element-type '(unsigned-byte 8))))
    (cffi:with-pointer-to-vector-data (to octets)
      (cffi:foreign-funcall "memcpy" :pointer to :pointer pointer :size length :pointer))
    octets))

(defun note-http2-stream-whole (stream)
  "STREAM's request is whole, or refused: it is ready to be answered."
  (when (eq (http2-stream-state stream) :open)
    (setf (http2-stream-state stream) :queued)
    (push stream (http2-session-ready *http2-session*))))

(defmacro define-http2-callback (name return-type (&rest arguments) &body body)
  "A callback of the library: BODY's value, or its failure code when BODY
signals (the session then ends with INTERNAL_ERROR)."
  (let ((declarations (loop while (and (consp (first body)) (eq (first (first body)) 'declare))
                            collect (pop body))))
    `(cffi:defcallback ,name ,return-type (,@arguments)
       ,@declarations
       (handler-case (progn ,@body)
         (error () +nghttp2-err-callback-failure+)))))

(define-http2-callback http2-begin-headers :int ((session :pointer) (frame :pointer) (user-data :pointer))
  (declare (ignore session user-data))
  (let ((id (cffi:foreign-slot-value frame '(:struct nghttp2-frame-hd) 'stream-id)))
    (unless (http2-stream-of id)
      (atomic-increment (connection-counters-http2-streams (http2-session-counters *http2-session*)))
      (incf (http2-session-opened-streams *http2-session*))
      (setf (gethash id (http2-session-streams *http2-session*)) (make-http2-stream id)))
    0))

(define-http2-callback http2-header :int ((session :pointer) (frame :pointer) (name :pointer) (name-length :size)
                                         (value :pointer) (value-length :size) (flags :uint8) (user-data :pointer))
  (declare (ignore session flags user-data))
  (let ((stream (http2-stream-of (cffi:foreign-slot-value frame '(:struct nghttp2-frame-hd) 'stream-id)))
        (max-header-bytes (http2-session-max-header-bytes *http2-session*)))
    (cond ((or (null stream) (http2-stream-headers-done-p stream)) 0)
          ((> (incf (http2-stream-header-list-size stream) (+ name-length value-length +http2-header-overhead+))
              (* +http2-header-list-slack+ max-header-bytes))
           (note-http2-flood *http2-session*))
          ((> (http2-stream-header-list-size stream) max-header-bytes)
           ;; Refused; its fields are no more copied.
           (unless (http2-stream-refusal stream)
             (setf (http2-stream-refusal stream) 431))
           0)
          (t (note-http2-header stream (foreign-octets name name-length) (foreign-octets value value-length)
                                (http2-session-max-body-bytes *http2-session*))
             0))))

(define-http2-callback http2-frame-received :int ((session :pointer) (frame :pointer) (user-data :pointer))
  (declare (ignore session user-data))
  (let* ((type (cffi:foreign-slot-value frame '(:struct nghttp2-frame-hd) 'type))
         (flags (cffi:foreign-slot-value frame '(:struct nghttp2-frame-hd) 'flags))
         (stream (http2-stream-of (cffi:foreign-slot-value frame '(:struct nghttp2-frame-hd) 'stream-id)))
         (end-stream-p (logtest flags +nghttp2-flag-end-stream+)))
    (cond ((null stream))
          ((= type +nghttp2-headers+)
           (setf (http2-stream-headers-done-p stream) t)
           (when (or end-stream-p (http2-stream-refusal stream))
             (note-http2-stream-whole stream)))
          ((and (= type +nghttp2-data+) (or end-stream-p (http2-stream-refusal stream)))
           (note-http2-stream-whole stream)))
    0))

(define-http2-callback http2-data-chunk :int ((session :pointer) (flags :uint8) (stream-id :int32)
                                              (data :pointer) (length :size) (user-data :pointer))
  (declare (ignore session flags user-data))
  (let ((stream (http2-stream-of stream-id)))
    (when (and stream (eq (http2-stream-state stream) :open))
      (add-http2-body-piece stream (foreign-octets data length) (http2-session-budget *http2-session*)
                            (http2-session-max-body-bytes *http2-session*)))
    0))

(define-http2-callback http2-stream-closed :int ((session :pointer) (stream-id :int32) (error-code :uint32)
                                                 (user-data :pointer))
  (declare (ignore session user-data))
  (let ((stream (http2-stream-of stream-id)))
    (when stream
      (unless (or (zerop error-code) (eq (http2-stream-state stream) :answered))
        (atomic-increment (connection-counters-http2-streams-reset (http2-session-counters *http2-session*))))
      (drop-http2-stream-body stream (http2-session-budget *http2-session*))
      (setf (http2-stream-state stream) :closed)
      (remhash stream-id (http2-session-streams *http2-session*))
      (note-http2-stream-closed *http2-session* stream))
    0))

(define-http2-callback http2-read-reply-body :long ((session :pointer) (stream-id :int32) (buffer :pointer)
                                                    (length :size) (data-flags :pointer) (source :pointer)
                                                    (user-data :pointer))
  (declare (ignore session source user-data))
  (let ((stream (http2-stream-of stream-id)))
    (cond ((null stream) +nghttp2-err-temporal-callback-failure+)
          ((and (null (http2-stream-reply-pieces stream)) (not (http2-stream-reply-ended-p stream)))
           (setf (http2-stream-reply-deferred-p stream) t)
           +nghttp2-err-deferred+)
          (t (let ((count (read-http2-reply-octets *http2-session* stream buffer length)))
               (when (and (null (http2-stream-reply-pieces stream)) (http2-stream-reply-ended-p stream))
                 (setf (cffi:mem-ref data-flags :uint32) +nghttp2-data-flag-eof+))
               count)))))

(define-http2-callback http2-frame-begins :int ((session :pointer) (head :pointer) (user-data :pointer))
  (declare (ignore session user-data))
  (if (http2-frame-allowed-p *http2-session* (cffi:foreign-slot-value head '(:struct nghttp2-frame-hd) 'type)
                             (cffi:foreign-slot-value head '(:struct nghttp2-frame-hd) 'stream-id)
                             (cffi:foreign-slot-value head '(:struct nghttp2-frame-hd) 'length)
                             (cffi:foreign-slot-value head '(:struct nghttp2-frame-hd) 'flags))
      0
      +nghttp2-err-callback-failure+))

(define-http2-callback http2-frame-sent :int ((session :pointer) (frame :pointer) (user-data :pointer))
  (declare (ignore session user-data))
  ;; The library's own GOAWAYs carry an error; the engine's, NO_ERROR.
  (when (and (= (cffi:foreign-slot-value frame '(:struct nghttp2-frame-hd) 'type) +nghttp2-goaway+)
             (/= (cffi:foreign-slot-value frame '(:struct nghttp2-goaway) 'error-code) +nghttp2-no-error+))
    (count-http2-goaway (http2-session-counters *http2-session*)
                        (if (http2-session-flooded-p *http2-session*) :flood :protocol-error)))
  0)

;;; The callbacks, made once: each session copies them.

(defvar *http2-callbacks* nil)

(defvar *http2-callbacks-lock* (bt:make-lock "http2-callbacks"))

(defun http2-callbacks ()
  (or *http2-callbacks*
      (bt:with-lock-held (*http2-callbacks-lock*)
        (or *http2-callbacks*
            (cffi:with-foreign-object (pointer :pointer)
              (unless (zerop (%nghttp2-callbacks-new pointer))
                (error "libnghttp2 could not make its callbacks."))
              (let ((callbacks (cffi:mem-ref pointer :pointer)))
                (%nghttp2-set-on-begin-headers callbacks (cffi:callback http2-begin-headers))
                (%nghttp2-set-on-header callbacks (cffi:callback http2-header))
                (%nghttp2-set-on-frame-recv callbacks (cffi:callback http2-frame-received))
                (%nghttp2-set-on-data-chunk-recv callbacks (cffi:callback http2-data-chunk))
                (%nghttp2-set-on-stream-close callbacks (cffi:callback http2-stream-closed))
                (%nghttp2-set-on-frame-send callbacks (cffi:callback http2-frame-sent))
                (%nghttp2-set-on-begin-frame callbacks (cffi:callback http2-frame-begins))
                (setf *http2-callbacks* callbacks)))))))

;;; The session.

(defun make-http2-session (&key max-concurrent-streams max-header-bytes max-body-bytes budget counters)
  "A server session announcing MAX-CONCURRENT-STREAMS and a header list of
MAX-HEADER-BYTES in its SETTINGS (queued, taken with the first output),
refusing bodies past MAX-BODY-BYTES (NIL: none), keeping bodies and
replies in BUDGET, counting into COUNTERS.  Free it with FREE-HTTP2-SESSION."
  (let ((session (%make-http2-session :max-header-bytes max-header-bytes :max-body-bytes max-body-bytes
                                      :budget budget :counters counters)))
    (cffi:with-foreign-object (pointer :pointer)
      (unless (zerop (%nghttp2-session-server-new pointer (http2-callbacks) (cffi:null-pointer)))
        (error "libnghttp2 could not make a session."))
      (setf (http2-session-pointer session) (cffi:mem-ref pointer :pointer)))
    (cffi:with-foreign-object (entries '(:struct nghttp2-settings-entry) 2)
      (loop for (id value) in `((,+nghttp2-settings-max-concurrent-streams+ ,max-concurrent-streams)
                                (,+nghttp2-settings-max-header-list-size+ ,max-header-bytes))
            for i from 0
            do (let ((entry (cffi:mem-aptr entries '(:struct nghttp2-settings-entry) i)))
                 (setf (cffi:foreign-slot-value entry '(:struct nghttp2-settings-entry) 'settings-id) id
                       (cffi:foreign-slot-value entry '(:struct nghttp2-settings-entry) 'value) value)))
      (%nghttp2-submit-settings (http2-session-pointer session) 0 entries 2))
    session))

(defmacro with-http2-session ((session) &body body)
  "BODY with SESSION's lock held and the callbacks finding it; NIL without
running BODY when SESSION has been freed."
  `(bt:with-lock-held ((http2-session-lock ,session))
     (unless (cffi:null-pointer-p (http2-session-pointer ,session))
       (let ((*http2-session* ,session))
         ,@body))))

(defun free-http2-session (session)
  "Free SESSION's library state and the bodies and replies its streams keep."
  (with-http2-session (session)
    (loop for stream being the hash-values of (http2-session-streams session)
          do (drop-http2-stream-body stream (http2-session-budget session))
             (setf (http2-stream-state stream) :closed)
             (note-http2-stream-closed session stream))
    (clrhash (http2-session-streams session))
    (%nghttp2-session-del (shiftf (http2-session-pointer session) (cffi:null-pointer)))))

(defun receive-http2-octets (session octets start end)
  "Give the octets of OCTETS from START below END, from the client, to
SESSION.  The streams whose requests became whole, oldest first; second
value, NIL, or the library's reason (a string) when the connection is to
end (its GOAWAY is then queued, taken by TAKE-HTTP2-OUTPUT)."
  (with-http2-session (session)
    (let ((result (cffi:with-pointer-to-vector-data (pointer octets)
                    (%nghttp2-session-mem-recv (http2-session-pointer session)
                                               (cffi:inc-pointer pointer start) (- end start)))))
      (when (minusp result)
        ;; The session is broken: its GOAWAY goes out, then it ends.
        (%nghttp2-session-terminate (http2-session-pointer session)
                                    (cond ((http2-session-flooded-p session) +nghttp2-enhance-your-calm+)
                                          ((http2-session-protocol-error-p session) +nghttp2-protocol-error+)
                                          (t +nghttp2-internal-error+))))
      (values (nreverse (shiftf (http2-session-ready session) '()))
              (when (minusp result) (%nghttp2-strerror result))))))

(defun take-http2-output (session room deliver)
  "Take the frames SESSION has to send while the function ROOM, called
with SESSION's lock held, says there is room for more (a count of
octets), one frame at most passing it; call DELIVER with them, fresh
octets, while the lock is still held, so that output taken by two threads
is delivered in the order it was taken.  True when there were some."
  (with-http2-session (session)
    (let ((pieces '())
          (total 0)
          (limit (funcall room))
          (pointer (http2-session-pointer session)))
      (cffi:with-foreign-object (data :pointer)
        (loop while (< total limit)
              do (let ((count (%nghttp2-session-mem-send pointer data)))
                   (when (<= count 0) (return))
                   (let ((piece (make-array count :element-type '(unsigned-byte 8))))
                     (cffi:with-pointer-to-vector-data (to piece)
                       (cffi:foreign-funcall "memcpy" :pointer to :pointer (cffi:mem-ref data :pointer)
                                                      :size count :pointer))
                     (push piece pieces)
                     (incf total count)))))
      (when pieces
        (funcall deliver (if (null (rest pieces))
                             (first pieces)
                             (let ((octets (make-array total :element-type '(unsigned-byte 8)))
                                   (position 0))
                               (dolist (piece (nreverse pieces) octets)
                                 (replace octets piece :start1 position)
                                 (incf position (length piece))))))
        t))))

(defun http2-session-open-stream-count (session)
  "The streams of SESSION not closed yet."
  (or (with-http2-session (session) (hash-table-count (http2-session-streams session))) 0))

(defun http2-session-active-p (session)
  "True while SESSION reads or has frames to write: false once it ended
(both sides sent GOAWAY, or a fatal error) with nothing left to send."
  (with-http2-session (session)
    (let ((pointer (http2-session-pointer session)))
      (or (plusp (%nghttp2-session-want-read pointer))
          (plusp (%nghttp2-session-want-write pointer))))))

;;; Replies.

(defun fill-header-fields (nva fields text)
  "Make NVA, a foreign array of nghttp2_nv, name FIELDS (an alist of
strings), whose octets are at TEXT one after the other (HEADER-FIELDS-TEXT)."
  (let ((position 0))
    (loop for (name . value) in fields
          for i from 0
          do (let ((entry (cffi:mem-aptr nva '(:struct nghttp2-nv) i)))
               (setf (cffi:foreign-slot-value entry '(:struct nghttp2-nv) 'name) (cffi:inc-pointer text position)
                     (cffi:foreign-slot-value entry '(:struct nghttp2-nv) 'namelen) (length name)
                     (cffi:foreign-slot-value entry '(:struct nghttp2-nv) 'value)
                     (cffi:inc-pointer text (+ position (length name)))
                     (cffi:foreign-slot-value entry '(:struct nghttp2-nv) 'valuelen) (length value)
                     (cffi:foreign-slot-value entry '(:struct nghttp2-nv) 'flags) 0)
               (incf position (+ (length name) (length value)))))))

(defun %submit-http2-reply-head (session stream status headers body-p)
  "SUBMIT-HTTP2-REPLY-HEAD with SESSION's lock held."
  (when (eq (http2-stream-state stream) :queued)
    (setf (http2-stream-state stream) :answered)
    (let* ((fields (cons (cons ":status" (princ-to-string status)) headers))
           (count (length fields))
           (octets (header-fields-text fields)))
      (cffi:with-foreign-objects ((nva '(:struct nghttp2-nv) count)
                                  (provider '(:struct nghttp2-data-provider)))
        (cffi:with-pointer-to-vector-data (text octets)
          ;; The library copies the fields, while OCTETS stay where they are.
          (fill-header-fields nva fields text)
          (setf (cffi:foreign-slot-value provider '(:struct nghttp2-data-provider) 'source) (cffi:null-pointer)
                (cffi:foreign-slot-value provider '(:struct nghttp2-data-provider) 'read-callback)
                (cffi:callback http2-read-reply-body))
          (zerop (%nghttp2-submit-response (http2-session-pointer session) (http2-stream-id stream) nva count
                                           (if body-p provider (cffi:null-pointer)))))))))

(defun submit-http2-reply-head (session stream status headers body-p)
  "Submit the HEADERS of STREAM's reply: STATUS and HEADERS (an alist of
lower-case name and value strings); with a body to come when BODY-P (read
as QUEUE-HTTP2-REPLY-OCTETS gives it), else the stream's end.  False when
STREAM or SESSION has ended, or the stream was answered."
  (with-http2-session (session)
    (%submit-http2-reply-head session stream status headers body-p)))

(defun resume-http2-reply (session stream)
  "Let the library read STREAM's reply again if it was waiting for more.
With SESSION's lock held."
  (when (http2-stream-reply-deferred-p stream)
    (setf (http2-stream-reply-deferred-p stream) nil)
    (%nghttp2-session-resume-data (http2-session-pointer session) (http2-stream-id stream))))

(defun %queue-http2-reply-octets (session stream octets reserve)
  "QUEUE-HTTP2-REPLY-OCTETS with SESSION's lock held."
  (cond
    ((eq (http2-stream-state stream) :closed) nil)
    ((and reserve (not (reserve-memory (http2-session-budget session) (length octets)))) :no-memory)
    (t (let ((cell (list octets)))
         (if (http2-stream-reply-pieces stream)
             (setf (cdr (http2-stream-reply-pieces-tail stream)) cell)
             (setf (http2-stream-reply-pieces stream) cell))
         (setf (http2-stream-reply-pieces-tail stream) cell))
       (incf (http2-stream-reply-queued stream) (length octets))
       (incf (http2-stream-reply-made stream) (length octets))
       (incf (http2-session-reply-octets session) (length octets))
       (unless reserve
         (charge-memory (http2-session-budget session) (length octets)))
       (resume-http2-reply session stream)
       t)))

(defun queue-http2-reply-octets (session stream octets &key reserve)
  "Add OCTETS, a vector no one changes from now on, to STREAM's reply body,
charged to SESSION's memory budget until the library reads them -- or,
when RESERVE, taken from it only if they fit (else :NO-MEMORY, nothing
added).  False, nothing added, when STREAM or SESSION has ended."
  (with-http2-session (session)
    (%queue-http2-reply-octets session stream octets reserve)))

(defun end-http2-reply-body (session stream)
  "End STREAM's reply body: the library ends the stream once it has read
what waits."
  (with-http2-session (session)
    (unless (eq (http2-stream-state stream) :closed)
      (setf (http2-stream-reply-ended-p stream) t)
      (resume-http2-reply session stream))))

(defun submit-http2-whole-reply (session stream status headers body &key reserve)
  "Submit STREAM's whole reply, STATUS, HEADERS and BODY (octets or NIL),
in one hold of SESSION's lock, as SUBMIT-HTTP2-REPLY-HEAD, QUEUE-HTTP2-
REPLY-OCTETS and END-HTTP2-REPLY-BODY would: true, :NO-MEMORY or false."
  (with-http2-session (session)
    (when (eq (http2-stream-state stream) :queued)
      (let ((queued (or (null body) (zerop (length body))
                        (%queue-http2-reply-octets session stream body reserve))))
        (if (eq queued :no-memory)
            :no-memory
            (progn (setf (http2-stream-reply-ended-p stream) t)
                   (%submit-http2-reply-head session stream status headers
                                             (and body (plusp (length body))))))))))

(defun refuse-http2-stream (session stream)
  "Reset STREAM of SESSION with REFUSED_STREAM: the client may send it again
(RFC 9113 8.7).  Its handler never ran."
  (with-http2-session (session)
    (when (eq (http2-stream-state stream) :queued)
      (setf (http2-stream-state stream) :answered)
      (%nghttp2-submit-rst-stream (http2-session-pointer session) 0 (http2-stream-id stream)
                                  +nghttp2-refused-stream+))))

(defun reset-http2-stream (session stream)
  "Reset STREAM of SESSION with INTERNAL_ERROR: its reply was begun and
cannot be ended as it should (its maker failed, or waited past the write
timeout)."
  (with-http2-session (session)
    (unless (eq (http2-stream-state stream) :closed)
      (%nghttp2-submit-rst-stream (http2-session-pointer session) 0 (http2-stream-id stream)
                                  +nghttp2-internal-error+))))

(defun submit-http2-goaway (session)
  "Queue SESSION's GOAWAY, NO_ERROR, naming the last stream it processed:
the client sends no new stream, and those begun are answered."
  (with-http2-session (session)
    (let ((pointer (http2-session-pointer session)))
      (%nghttp2-submit-goaway pointer 0 (%nghttp2-last-processed-stream-id pointer) +nghttp2-no-error+
                              (cffi:null-pointer) 0))))
