;;;; Hunchentoot's own confidence test -- the handlers and the script its
;;;; test/ folder ships, unchanged -- run against a parallel acceptor as
;;;; against Hunchentoot's EASY-ACCEPTOR, over HTTP and over TLS, and the
;;;; pages of those handlers the script does not ask for answered byte for
;;;; byte as Hunchentoot's acceptor answers them.  Part of the compatibility
;;;; suite: the files are loaded when the first of these tests runs, from
;;;; the test/ folder of the Hunchentoot under test, or from Hunchentoot
;;;; 1.3.1's in VENDOR where that Hunchentoot ships none (Debian's package
;;;; does not).

(in-package #:hunchentoot-recycling-taskmaster-test)

(in-suite compatibility)

(defun confidence-script-folder ()
  "The folder of Hunchentoot's test handlers and script, or NIL when neither
the Hunchentoot loaded nor VENDOR's hunchentoot-1.3.1 has one."
  (flet ((script-folder (folder)
           (and (probe-file (merge-pathnames "script.lisp" folder)) folder)))
    (let ((vendor (uiop:getenv "VENDOR")))
      (or (script-folder (merge-pathnames "test/" (asdf:system-source-directory "hunchentoot")))
          (and vendor (script-folder (merge-pathnames "hunchentoot-1.3.1/test/"
                                                      (uiop:ensure-directory-pathname vendor))))))))

(defvar *confidence-dispatch-table* nil
  "The dispatch table of Hunchentoot's test handlers, once they are loaded.")

(defun confidence-script-symbol (name)
  (find-symbol name "HUNCHENTOOT-TEST"))

(defun load-confidence-script ()
  "Load Hunchentoot's test handlers and script once; their dispatch table.
The handlers' file sets *DISPATCH-TABLE* as it loads; the table is kept
here and the global one put back, for the other tests' acceptors."
  (or *confidence-dispatch-table*
      (let ((folder (confidence-script-folder))
            (dispatch-table ht:*dispatch-table*))
        (assert folder () "no test/script.lisp in the Hunchentoot loaded or in VENDOR's hunchentoot-1.3.1")
        (unwind-protect
             (let ((*standard-output* (make-broadcast-stream))
                   (*error-output* (make-broadcast-stream)))
               (handler-bind ((warning #'muffle-warning))
                 (dolist (name '("packages" "test-handlers" "script-engine" "script"))
                   (load (merge-pathnames (make-pathname :name name :type "lisp") folder))))
               (setf *confidence-dispatch-table* ht:*dispatch-table*))
          (setf ht:*dispatch-table* dispatch-table)))))

(defmacro with-confidence-handlers (() &body body)
  "Run BODY with Hunchentoot's test handlers as the global dispatch table,
the one workers read, and a scratch folder of their own for the files they
are sent."
  (let ((dispatch-table (gensym "DISPATCH-TABLE"))
        (upload-folder (gensym "UPLOAD-FOLDER")))
    `(let ((,dispatch-table ht:*dispatch-table*))
       (setf ht:*dispatch-table* (load-confidence-script))
       (let ((,upload-folder (pathname (make-scratch-folder))))
         (setf (symbol-value (confidence-script-symbol "*TMP-TEST-DIRECTORY*")) ,upload-folder)
         (unwind-protect (progn ,@body)
           (uiop:delete-directory-tree ,upload-folder :validate t :if-does-not-exist :ignore)
           (setf ht:*dispatch-table* ,dispatch-table))))))

(defun run-confidence-script (class &rest initargs)
  "Run Hunchentoot's confidence script against an acceptor of CLASS made of
INITARGS on 127.0.0.1: the failures it signalled, as text (an error that
ended it among them), and what it printed."
  (let ((failures '())
        (output (make-string-output-stream))
        (failure-type (confidence-script-symbol "TEST-FAILURE"))
        (wake-check (confidence-script-symbol "TEST-ACCEPTOR-WAKE")))
    (with-server (server (apply #'make-server class initargs))
      (let ((wildcard-wake-check (fdefinition wake-check)))
        ;; The script ends by checking that Hunchentoot's own acceptor
        ;; wakes from its accept on the wildcard address; tests here listen
        ;; on loopback only, so it checks that on 127.0.0.1.
        (setf (fdefinition wake-check)
              (lambda (address) (declare (ignore address)) (funcall wildcard-wake-check "127.0.0.1")))
        (unwind-protect
             (handler-bind ((condition (lambda (condition)
                                         (when (typep condition failure-type)
                                           (push (princ-to-string condition) failures)))))
               (handler-case
                   (bt:with-timeout (120)
                     (let ((*standard-output* output))
                       (funcall (confidence-script-symbol "TEST-HUNCHENTOOT") (url server ""))))
                 (serious-condition (condition)
                   (push (format nil "the script ended: ~A" condition) failures))))
          (setf (fdefinition wake-check) wildcard-wake-check))))
    (values (reverse failures) (get-output-stream-string output))))

(defun text-head (text &optional (length 300))
  (if (> (length text) length)
      (concatenate 'string (subseq text 0 length) "...")
      text))

(defun check-confidence-script (classes &rest initargs)
  "Run Hunchentoot's confidence script against an acceptor of each of
CLASSES made of INITARGS; each must pass it."
  (with-confidence-handlers ()
    (dolist (class classes)
      (multiple-value-bind (failures output)
          (with-thread-leak-check () (apply #'run-confidence-script class initargs))
        (is (null failures) "Hunchentoot's confidence script against ~A failed ~D time~:P:~{~%  ~A~}"
            class (length failures) (mapcar #'text-head failures))
        (is (search "all tests PASSED" output) "the script against ~A did not pass; it printed:~%~A"
            class (text-head output 2000))))))

(test compatibility.hunchentoot-confidence-script-passes-on-ours
  (check-confidence-script '(parallel-easy-acceptor ht:easy-acceptor)))

(test compatibility.hunchentoot-confidence-script-passes-on-ours-over-tls
  (multiple-value-bind (certificate key) (certificate-files)
    (check-confidence-script '(parallel-easy-ssl-acceptor ht:easy-ssl-acceptor)
                             :ssl-certificate-file certificate :ssl-privatekey-file key)))

(defparameter *pages-the-script-skips*
  (list
   ;; The handler writes to the stream SEND-HEADERS returns: octets,
   ;; characters through a flexi-stream, a string.
   (get-request "/hunchentoot/test/utf8-binary.txt")
   (get-request "/hunchentoot/test/utf8-character.txt")
   (get-request "/hunchentoot/test/utf8-string.txt")
   ;; RETURN-CODE set by the handler, an error inside it, no handler.
   (get-request "/hunchentoot/test/forbidden.html")
   (get-request "/hunchentoot/test/oops.html")
   (get-request "/hunchentoot/foo")
   ;; CREATE-FOLDER-DISPATCHER-AND-HANDLER: a file, the folder itself.
   (get-request "/hunchentoot/code/packages.lisp")
   (get-request "/hunchentoot/code/")
   (get-request "/hunchentoot/test/favicon.ico")
   (crlf-lines "HEAD /hunchentoot/test/image.jpg HTTP/1.1" "Host: localhost" "")
   ;; DEFINE-EASY-HANDLER with typed parameters, absent and given.
   (get-request "/hunchentoot/test/easy-demo.html")
   (get-request "/hunchentoot/test/easy-demo.html?first-name=Ada&last-name=Lovelace&age=36")
   (concatenate 'string
                (crlf-lines "POST /hunchentoot/test/easy-demo.html HTTP/1.1" "Host: localhost"
                            "Content-Type: application/x-www-form-urlencoded" "Content-Length: 20" "")
                "first-name=Ada&age=x"))
  "Requests for the pages of Hunchentoot's test handlers its script does not check.")

(test compatibility.hunchentoot-test-pages-answer-as-on-hunchentoots-own
  (with-confidence-handlers ()
    (check-same-replies *pages-the-script-skips*)))
